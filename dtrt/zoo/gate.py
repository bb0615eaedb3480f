"""The quality gate a registry model's default target configuration must pass against the fp32 PyTorch reference
of the same checkpoint (`dtrt quality --gate` measures it; the registry records the result beside the default and
refuses a quantized default without a passing one).

Speed alone chose SmolLM2's int8 default once; its answers then fell into loops on AVX-512 VNNI CPUs while the fp32
reference answered well. The gate asks what a user sees: the first tokens of real answers, not only a mean NLL.
"""

from dataclasses import dataclass


def loops(tokens: list[int], *, tail: int = 32, max_period: int = 16) -> bool:
    """Whether an answer has fallen into a repetition loop: its last `tail` tokens are one n-gram (n <= `max_period`)
    repeated, each token equal to the one n before it ("la femme, la femme, la femme, ..." is a 4-token period)."""
    for period in range(1, max_period + 1):
        if len(tokens) < tail + period:
            break
        if all(tokens[-i] == tokens[-i - period] for i in range(1, tail + 1)):
            return True
    return False


def same_start(a: list[int], b: list[int], n: int) -> bool:
    """Whether two answers are the same over their first `n` tokens (the whole of a shorter one that ended)."""
    return a[:n] == b[:n]


@dataclass(frozen=True)
class QualityGate:
    """The thresholds, per dataset (MT-Bench and HumanEval by default)."""

    agreement: float = 0.99
    """Teacher-forced greedy agreement with the reference: the share of positions whose argmax is the reference's."""
    nll: float = 0.01
    """The most the mean NLL per token (nats) may differ from the reference's."""
    identical: float = 0.90
    """Free-running: the share of answers (chat template, greedy) the same as the reference's over `first` tokens."""
    first: int = 32
    """How many first tokens of each answer `identical` compares."""
    new_loops: int = 0
    """Answers that loop (`loops`) where the reference's answer to the same prompt does not."""

    def failures(self, row: dict) -> list[str]:
        """What a row of `dtrt quality` (one configuration on one dataset) misses, in words; [] when it passes."""
        out = []
        if row["agreement"] < self.agreement:
            out.append(f"agreement {row['agreement']:.4f} < {self.agreement}")
        if abs(row["nll_delta"]) > self.nll:
            out.append(f"nll {row['nll_delta']:+.4f} beyond {self.nll}")
        if row.get("answers"):
            if row["identical"] < self.identical:
                out.append(f"identical over {self.first} tokens {row['identical']:.2f} < {self.identical}")
            if row["new_loops"] > self.new_loops:
                out.append(f"{row['new_loops']} answers loop where the reference's do not")
        return out


GATE = QualityGate()


@dataclass(frozen=True)
class GateRecord:
    """A measured gate result for a model's default target configuration, as `dtrt quality --gate` printed it (the
    lowest figure over the datasets and kernel paths measured)."""

    config: str
    """The target configuration measured: `none` (fp32), `int8`, `int4`."""
    agreement: float
    nll_delta: float
    identical: float
    new_loops: int
    kernel_paths: tuple[str, ...]
    """The CPU kernel paths it was measured on (dtrt.artifacts.kernel_path)."""
    command: str
    """The command that measured it."""

    @property
    def passed(self) -> bool:
        row = {
            "agreement": self.agreement,
            "nll_delta": self.nll_delta,
            "identical": self.identical,
            "new_loops": self.new_loops,
            "answers": 1,
        }
        return not GATE.failures(row)
