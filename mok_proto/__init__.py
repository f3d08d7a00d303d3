"""mok_proto: a readable research prototype of the Mixture-of-Kittens MoE megakernel.

Three layers, one direction of data flow:
  math      -- mok_proto.reference   (NumPy/CuPy oracle of the MoE layer)
  protocol  -- mok_proto.schedule, mok_proto.symm, mok_proto.layer
  kernels   -- mok_proto.kernels + cuda/ (GPU only, imported lazily)
"""

__version__ = "0.1.0"
