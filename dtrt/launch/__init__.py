"""What the front ends (`dtrt run`, `dtrt serve`, `dtrt bench`, the benchmark scripts) decide before the runtime
starts (start.py): the RunSpec from their flags with every default applied, its sources opened (registry names
resolved, exports and engines read and checked) and the pipeline over them; the export a registry model runs from,
made on first use (first_use.py), and whether it fits this machine's memory (memory.py)."""

from dtrt.launch.start import open_sources, pipeline, resolve_spec, served_model_name

__all__ = ["open_sources", "pipeline", "resolve_spec", "served_model_name"]
