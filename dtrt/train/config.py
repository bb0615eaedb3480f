"""The options of `dtrt drafter-data` (DataGenConfig) and `dtrt train-drafter` (TrainConfig), as plain values: their
flags are generated from these fields without importing torch; dtrt.train.datagen and dtrt.train.trainer run them."""

from dataclasses import dataclass, fields
from typing import Literal

from dtrt.errors import DtrtError


@dataclass
class DataGenConfig:
    """`dtrt drafter-data`'s options: which responses the target writes and how they are sharded (the command's
    flags are generated from these fields)."""

    samples: int = 1
    """Responses per prompt: sample 0 greedy, the others sampled."""
    temperature: float = 0.8
    """Of the sampled responses (sample 0 is greedy)."""
    top_p: float = 0.95
    """Of the sampled responses."""
    seed: int = 0
    """The sampled responses' seeds."""
    max_new_tokens: int = 256
    """Tokens per response."""
    max_prompt_tokens: int = 1024
    """Longer prompts (or later turns) are skipped."""
    batch: int = 32
    """Prompts decoded together."""
    shard_rows: int = 256
    """(prompt, sample) pairs per shard (each turn of a conversation is a row); corpus rows per corpus shard."""
    chat: bool = True
    """Wrap prompts in the chat template."""
    corpus_chars: int = 20_000_000
    """Characters read from --corpus."""
    corpus_row_tokens: int = 512
    """Tokens per corpus row."""
    device: str = "cpu"
    """cpu or cuda."""

    def __post_init__(self):
        for name in ("samples", "max_new_tokens", "max_prompt_tokens", "batch", "shard_rows", "corpus_chars"):
            if getattr(self, name) < 1:
                raise DtrtError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be >= 1")
        if self.corpus_row_tokens < 2:
            raise DtrtError(f"--corpus-row-tokens {self.corpus_row_tokens}: must be >= 2")
        if self.samples > 1 and not self.temperature > 0:
            raise DtrtError(
                f"--temperature {self.temperature} with --samples {self.samples}: sampled responses need a "
                "temperature > 0 (sample 0 is the greedy one)"
            )
        if not 0 < self.top_p <= 1:
            raise DtrtError(f"--top-p {self.top_p}: must be in (0, 1]")

    def row_options(self) -> dict:
        """The options that decide the rows (all but the device): a resumed run must keep them."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "device"}


@dataclass
class TrainConfig:
    """`dtrt train-drafter`'s options: the drafter's shape, its data, the schedule, the evaluations (the command's
    flags are generated from these fields)."""

    layers: int = 1
    """Decoder layers of the drafter."""
    block_size: int = 8
    """The drafter's block: the root and block_size - 1 drafted positions."""
    gru_dim: int = 256
    """Hidden size of Domino's GRU head."""
    emb_dim: int = 128
    """Token embedding size of Domino's head."""
    seq_len: int = 256
    """Tokens per training row."""
    corpus_chars: int = 700_000
    """Characters read from --corpus."""
    corpus_rows: int = 400
    """Rows cut from --corpus."""
    gen_tokens: int = 96
    """Tokens the target generates per --prompts prompt (the rows it is trained on)."""
    gen_batch: int = 32
    """Prompts continued together."""
    data_rows: int = 1000
    """Windows kept per --data directory (a seeded subset; each stores seq-len x taps x hidden fp16 features on
    disk)."""
    steps: int = 1500
    """Optimizer steps (the learning rate's schedule follows them)."""
    batch: int = 8
    """Rows per step."""
    anchors: int = 8
    """Blocks per row."""
    lr: float = 1e-3
    """Peak learning rate."""
    slot_decay: float = 4.0
    """decay: the loss weight of draft depth d is exp(-d / this)."""
    slot_weighting: Literal["decay", "tau"] = "decay"
    """The loss weight of draft depth d: exp(-d / --slot-decay), or tau: how much a better acceptance at d adds to
    a chain's tau, from the running per-depth accuracy (dtrt.train.distill.tau_weights)."""
    candidates: int = 4096
    """Vocabulary entries the loss scores per step: the batch's labels and the target's top-8 at them, then uniform
    negatives weighted for the rest; 0 scores the full vocabulary."""
    eval_every: int = 300
    """Steps between evaluations (held-out tau; each also saves a checkpoint)."""
    save_every: int = 50
    """Steps between resumable checkpoints."""
    eval_prompts: int = 6
    """Prompts per held-out set."""
    eval_tokens: int = 48
    """Tokens generated per held-out prompt."""
    save_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    """The precision of the saved drafter checkpoints."""
    seed: int = 0
    """Seed of the data subsets, the initialization and the sampled candidates."""
    device: str = "cpu"
    """cpu or cuda."""
    init_from: str | None = None
    """A trained Domino checkpoint of the same shape (a run's domino/, a shipped drafter) to start from instead of
    the target's last layers: more data for a drafter without its first steps again."""
    features: Literal["disk", "memory"] = "disk"
    """disk: the resumable feature store under OUT/.train/data; memory: built on --device on every run, never
    written (a GPU with room for them: SmolLM2 takes 1.5 MB a 256-token row)."""
    feature_batch: int = 8
    """Rows the target featurizes per forward."""
    autocast: Literal["fp32", "bf16"] = "fp32"
    """The drafter's forward and loss under bf16 autocast."""
    time_limit_s: float = 0.0
    """Seconds after which the run, its data's build included, evaluates, saves and stops (0: none); the learning
    rate still follows --steps, so a caller that knows its step rate sets both."""
    eval_every_s: float = 0.0
    """Also evaluate once this many seconds of training passed since the last evaluation (0: never)."""
