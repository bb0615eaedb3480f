"""One CUDA graph of a step (the drafting graph, dtrt.runtime.draft_graph; the static rounds,
dtrt.runtime.verify_graph): warm-up calls on a side stream, then the capture."""

from collections.abc import Callable

import torch

from dtrt.errors import BackendFault, first_line


def capture(step: Callable[[], object], *, device: torch.device, flag: str, undo: Callable[[], None] = lambda: None):
    """(graph, step's outputs as captured). Two warm-up calls on a side stream first (each followed by `undo`, which
    puts back what a call moved): they compile the Triton kernels and the compiled parts and settle the allocator
    outside the capture. A failure is one line naming `flag`, the option to drop, unless it is already a fault."""
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
                undo()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = step()  # recorded, not run
    except BackendFault:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the capture is reported as one
        why = first_line(e)
        raise BackendFault(f"{flag}: capturing the step's CUDA graph failed ({why}); run without {flag}") from e
    return graph, outputs
