"""The front end's pieces that `dtrt run`, `dtrt serve`, `dtrt bench` and the trainer's prompts share: a request
(its fields, the chat template, the context fit: requests.py), the text of a generation (incremental decoding,
stop strings, `complete`: text.py), and prompt files and dataset texts as chat prompts (prompts.py). `dtrt run`'s
terminal (Ctrl-C, the interactive loop) is the command's own, in dtrt.cli.run."""
