"""One side of an A/B run (mok_proto.bench.ab): a process that imports `mok_proto` from the tree
under test (its PYTHONPATH, not this file's tree), builds the staged EP=64 share of one shape
(bench.emulation.staged_layer, uniform routing, seed 0), captures its forward and backward as CUDA
graphs (the sequential passes, or the fused ones with the knobs asked for), and times their
replays on request.

Protocol: one JSON object a line on stdin, one answer a line on the process's original stdout
(everything the library prints goes to stderr):
    {"cmd": "setup", "shape": NAME[, "precision": "fp8"][, "fused": "COMM:MINIBATCH[:CLAIM]"]}
                                     -> {"num_turns", "ring_rows", "digest": {"fwd", "bwd"}}
    {"cmd": "time", "pass": "fwd"|"bwd", "iters": K, "warmup": W} -> {"ms": [K replay times]}
    {"cmd": "close"}                 -> {} and the process ends
An error answers {"error": "..."} and ends the process. Only API that every tree the A/B compares
has is used here: emulated_shape, make_inputs(shape, seed), staged_layer(shape, data[, precision=]),
result_bytes, layer.capture / check / close, and with "fused" plan.FusedKnobs.parse and the
layer's fused_forward_plan / fused_backward_plan / set_forward_plan / set_backward_plan.
"""

import hashlib
import json
import os
import sys

if __name__ == "__main__":
    sys.path.pop(0)  # this file's folder: `mok_proto` must come from PYTHONPATH


class Side:
    """The staged layer of one shape and its two graphs."""

    def __init__(self, name: str, precision: str = "bf16", fused: str | None = None):
        import cupy

        from mok_proto.bench.emulation import emulated_shape, make_inputs, result_bytes, staged_layer

        shape = emulated_shape(name)
        run = {} if precision == "bf16" else {"precision": precision}  # (a tree without FP8 takes no such field)
        self.heap, self.layer = staged_layer(shape, make_inputs(shape, 0), **run)
        if fused is not None:
            from mok_proto.plan import FusedKnobs

            knobs = FusedKnobs.parse(fused)
            self.layer.set_forward_plan(self.layer.fused_forward_plan(knobs))
            self.layer.set_backward_plan(self.layer.fused_backward_plan(knobs))
            self.layer.enqueue_forward()  # compiles and uploads before the captures
            self.layer.enqueue_backward()
            self.layer.check()
        self.graphs = {"fwd": self.layer.capture(backward=False), "bwd": self.layer.capture(forward=False)}
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.digest = {}
        for name_ in ("fwd", "bwd"):
            self.graphs[name_].launch(self.stream)
            self.stream.synchronize()
            self.layer.check()
            self.digest[name_] = hashlib.sha256(result_bytes(self.layer, name_)).hexdigest()

    def describe(self) -> dict:
        return {"num_turns": int(getattr(self.layer, "num_turns", 1)),
                "ring_rows": getattr(self.layer, "ring_rows", None), "digest": self.digest}

    def time(self, pass_: str, iters: int, warmup: int) -> list:
        import cupy

        graph = self.graphs[pass_]
        for _ in range(warmup):
            graph.launch(self.stream)
        events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(iters)]
        for start, stop in events:
            start.record(self.stream)
            graph.launch(self.stream)
            stop.record(self.stream)
        self.stream.synchronize()
        self.layer.check()
        return [cupy.cuda.get_elapsed_time(start, stop) for start, stop in events]

    def close(self):
        self.layer.close()
        self.heap.close()


def serve(requests, answer) -> None:
    side = None
    for line in requests:
        req = json.loads(line)
        try:
            if req["cmd"] == "setup":
                if side is not None:
                    side.close()
                side = Side(req["shape"], req.get("precision", "bf16"), req.get("fused"))
                answer(side.describe())
            elif req["cmd"] == "time":
                answer({"ms": side.time(req["pass"], int(req["iters"]), int(req.get("warmup", 1)))})
            elif req["cmd"] == "close":
                if side is not None:
                    side.close()
                answer({})
                return
            else:
                raise ValueError(f"unknown command {req['cmd']!r}")
        except Exception as e:  # noqa: BLE001 - the driver reports it and stops
            answer({"error": f"{type(e).__name__}: {e}"})
            raise


def main() -> None:
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the library's prints go to stderr, the protocol keeps the original stdout

    def answer(obj):
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    serve(sys.stdin, answer)


if __name__ == "__main__":
    main()
