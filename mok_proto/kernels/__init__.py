"""GPU kernels: one Python wrapper per kernel (build, check inputs, launch). Sources in cuda/.

Importing this package needs no GPU; compiling or launching does (CuPy is imported lazily).
"""
