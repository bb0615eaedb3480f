"""The runtime: a RunSpec (spec.py) opened into a Pipeline (pipeline.py) over a backend (backends/), and the one
decode loop (generate.py) every method (methods.py) runs in, as a stream of rounds. Turning those rounds into text
(dtrt.frontend.text) and a terminal's Ctrl-C and prompt loop (dtrt.cli.run) belong to the front ends."""
