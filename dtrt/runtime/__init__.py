"""The runtime: a RunSpec (spec.py) opened into a Pipeline (pipeline.py) over a backend (backends/), and the one
decode loop (generate.py) every method (methods.py) runs in, streamed as text (text.py) to `dtrt run`'s terminal
(terminal.py) or the server."""
