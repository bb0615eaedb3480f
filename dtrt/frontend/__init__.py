"""The front end's pieces that `dtrt run`, `dtrt serve`, `dtrt bench` and the trainer's prompts share: a request
(its fields, the chat template, the context fit), the text of a generation (incremental decoding, stop strings,
`complete`), the terminal (Ctrl-C, the interactive loop), and prompt files and dataset texts as chat prompts."""
