"""Prometheus exposition with vLLM's metric names, written by hand (no client library).

Only the series abplat reads are kept; names, label and TTFT buckets are vLLM 0.32's (note the
TTFT histogram has no 0.2 s boundary, which is why the SLA is computed from raw samples).
"""

from __future__ import annotations

import bisect

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, v: float) -> None:
        i = bisect.bisect_left(self.buckets, v)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += 1
        self.sum += v

    def render(self, name: str, label: str) -> list[str]:
        out = [f"# TYPE {name} histogram"]
        acc = 0
        for le, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{{label},le="{le}"}} {float(acc)}')
        out.append(f'{name}_bucket{{{label},le="+Inf"}} {float(self.total)}')
        out.append(f"{name}_count{{{label}}} {float(self.total)}")
        out.append(f"{name}_sum{{{label}}} {self.sum}")
        return out


class Metrics:
    def __init__(self, model: str) -> None:
        self.model = model
        self.label = f'engine="0",model_name="{model}"'
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success: dict[str, int] = {}
        self.failed = 0
        self.aborted = 0
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.e2e = _Histogram(E2E_BUCKETS)

    def request_done(
        self,
        prompt_tokens: int,
        generated: int,
        ttft_s: float | None,
        e2e_s: float,
        max_tokens: int,
    ) -> None:
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generated
        reason = "length" if generated >= max_tokens else "stop"
        self.success[reason] = self.success.get(reason, 0) + 1
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        self.e2e.observe(e2e_s)

    def request_failed(self) -> None:
        self.failed += 1

    def request_aborted(self) -> None:
        self.aborted += 1

    def render(self, running: int, waiting: int) -> str:
        lb = self.label
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{lb}}} {float(running)}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{lb}}} {float(waiting)}",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{lb}}} {float(self.prompt_tokens)}",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{lb}}} {float(self.generation_tokens)}",
            "# TYPE vllm:request_success_total counter",
        ]
        for reason in ("stop", "length", "abort"):
            n = self.aborted if reason == "abort" else self.success.get(reason, 0)
            lines.append(
                f'vllm:request_success_total{{engine="0",finished_reason="{reason}",'
                f'model_name="{self.model}"}} {float(n)}'
            )
        lines.append("# TYPE abplat_sim_requests_failed_total counter")
        lines.append(f"abplat_sim_requests_failed_total{{{lb}}} {float(self.failed)}")
        lines += self.ttft.render("vllm:time_to_first_token_seconds", lb)
        lines += self.e2e.render("vllm:e2e_request_latency_seconds", lb)
        return "\n".join(lines) + "\n"
