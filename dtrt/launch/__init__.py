"""What the front ends (`dtrt run`, `dtrt serve`, `dtrt bench`, the benchmark scripts) decide before the runtime
starts: the RunSpec from their flags with every default applied (resolve.py), and its sources opened (sources.py:
registry names resolved, the first-use export of a registry model made, exports and engines read and checked)."""

from dtrt.launch.resolve import resolve_spec
from dtrt.launch.sources import open_sources, pipeline, served_model_name

__all__ = ["open_sources", "pipeline", "resolve_spec", "served_model_name"]
