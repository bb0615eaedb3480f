"""`dtrt bench`: methods x datasets x temperatures in one process, with paired bootstrap speedups over AR.

Protocol: every method (AR always) gets one pipeline and one warm-up generation, then the contenders take turns
on each prompt in a rotated order. A record is one prompt turn: tau is the mean over rounds of accepted drafts
+ 1, tok/s is generated tokens over decode time (the clock starts after prefill), and a table cell is the mean
over prompts of these per-prompt values. MT-Bench runs both turns; the second continues from the contender's own
first answer and is a record of its own. Speedup is AR time per token / the method's on the same prompt, with
a paired bootstrap 95% CI (stats.py). The optional llama.cpp row decodes a GGUF of the same target plainly."""
