"""The distributed layer: forward + backward per backend, written over mok_proto.symm."""
