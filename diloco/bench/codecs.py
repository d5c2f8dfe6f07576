"""`diloco bench codecs`: speed, size and error of every compression pipeline (benchmark B2).

For each pipeline and each input it measures, in one run on one machine:

- encode and decode time as a ratio to `torch.clone` of the same input in the same run (a memcpy
  baseline: ratios travel between machines better than seconds);
- bits per parameter of the encoded payload (everything the receiver needs: indices, scales,
  codebooks, headers);
- relative L2 error ‖x − decode(encode(x))‖ / ‖x‖ of one pass (no error feedback).

Inputs: a synthetic Gaussian vector, and the bundled demo model's real pseudo-gradient (θ₀ − θ_H
after H AdamW steps on the bundled corpus) tiled to the requested size, so codecs see a real
pseudo-gradient's distribution at sizes where throughput is meaningful. Every figure is the
median of `repeats` runs.

Encoding is timed as the swarm encodes a span (`Pipeline.encode_parts`): the payload as the codec wrote it, not
copied again into a new `bytes`.

`device="cuda"` puts the inputs on the GPU: the codecs encode there and their encoded bytes cross to the host
(into pinned memory), then decode back onto the GPU from those bytes (`Pipeline.decode(..., device)`); the clone
baseline is a copy on the GPU, and every timing waits for the GPU (`torch.cuda.synchronize`). Beside each, the
time a plain copy of as many bytes takes from the GPU into pinned host memory kept for it (`to_host_s`: the bus's
rate) and from a `bytes` object, as they arrive, onto the GPU (`to_device_s`): the part of encoding and decoding
that the bus, not the codec, sets. `profile` writes, for each pipeline, the
`torch.profiler` and `cProfile` tables of one encode and one decode after the timed ones.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from diloco.compression.pipeline import Pipeline

from .devices import kernel_seconds, median_time, profile_tables, waiter

DEFAULT_SPECS = (
    "fp32", "fp16", "bf16", "fp16+zstd", "q8", "q8+zstd", "q4", "q2", "s4", "s2", "fp8", "e3m0",
    "topk:64/4096+fp16", "topk:64/4096+s2", "topk:64/4096+s2+idx12", "topk:64/4096+q2", "topk:32/4096+s2",
    "randk:64/4096+s2",
)
DEFAULT_PIPELINE = "topk:64/4096+s2+ef:0.95"
"""The demo's and the docs' default sparse pipeline."""


@dataclass
class CodecResult:
    spec: str
    input: str
    numel: int
    bits_per_param: float
    rel_l2_error: float
    encode_s: float
    decode_s: float
    clone_s: float
    device: str = "cpu"
    to_host_s: float = 0.0
    """A plain copy of as many bytes as the payload from the device into pinned host memory (0 on the host)."""
    to_device_s: float = 0.0
    """A plain copy of the encoded bytes from the host (a `bytes` object, as they arrive) to the device (0 on the
    host)."""
    encode_kernels_s: float = 0.0
    """The GPU's kernels in one encode, summed (`torch.profiler`; copies to and from the host left out): the codec's
    own work on the device (0 on the host)."""
    decode_kernels_s: float = 0.0
    """The same for one decode."""
    clone_kernels_s: float = 0.0
    """The same for the clone."""

    def kernels_x(self, seconds: float) -> float:
        """Kernel time as a ratio to the clone's kernel (0 on the host)."""
        return seconds / self.clone_kernels_s if self.clone_kernels_s else 0.0

    @property
    def encode_x(self) -> float:
        return self.encode_s / self.clone_s

    @property
    def decode_x(self) -> float:
        return self.decode_s / self.clone_s

    @property
    def encode_gbps(self) -> float:
        """fp32 input encoded per second, GB/s."""
        return 4 * self.numel / self.encode_s / 1e9

    @property
    def on_device_x(self) -> float:
        """Encoding less the plain copy of its bytes to the host, as a ratio to the clone: the codec's own work."""
        return max(0.0, self.encode_s - self.to_host_s) / self.clone_s

    @property
    def decode_on_device_x(self) -> float:
        """Decoding less the plain copy of its bytes to the device, as a ratio to the clone: the codec's own work."""
        return max(0.0, self.decode_s - self.to_device_s) / self.clone_s

    def row(self) -> dict[str, Any]:
        return {**asdict(self), "encode_x_clone": round(self.encode_x, 2), "decode_x_clone": round(self.decode_x, 2),
                "encode_less_copy_x_clone": round(self.on_device_x, 2),
                "decode_less_copy_x_clone": round(self.decode_on_device_x, 2),
                "encode_kernels_x_clone": round(self.kernels_x(self.encode_kernels_s), 2),
                "decode_kernels_x_clone": round(self.kernels_x(self.decode_kernels_s), 2),
                "roundtrip_x_clone": round(self.encode_x + self.decode_x, 2), "encode_gbps": round(self.encode_gbps, 3)}


def demo_pseudo_gradient(steps: int = 25, seed: int = 0) -> torch.Tensor:
    """θ₀ − θ_H of the bundled GPT after `steps` AdamW steps on the bundled corpus (1.85M values)."""
    from ..job.corpus import BatchSampler, Corpus, CorpusConfig
    from ..job.model import GPTConfig, build_model
    from ..outer import flatten

    corpus = Corpus.load(CorpusConfig(max_bytes=1 << 20))
    model = build_model(GPTConfig(), seed=seed)
    start = flatten(model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sampler = BatchSampler(corpus.train, batch_size=8, context=128, seed=seed)
    for _ in range(steps):
        x, y = sampler.next()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return start - flatten(model.parameters())


def make_inputs(sizes: list[int], kinds: list[str], seed: int = 0) -> dict[str, torch.Tensor]:
    inputs: dict[str, torch.Tensor] = {}
    base = demo_pseudo_gradient() if "demo" in kinds else None
    g = torch.Generator().manual_seed(seed)
    for n in sizes:
        if "gaussian" in kinds:
            inputs[f"gaussian-{_size_name(n)}"] = torch.randn(n, generator=g)
        if base is not None:
            inputs[f"demo-{_size_name(n)}"] = base.repeat(-(-n // base.numel()))[:n].contiguous()
    return inputs


def _size_name(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else str(n)


def bench_codecs(specs: list[str], inputs: dict[str, torch.Tensor], repeats: int = 3,
                 progress: Callable[[CodecResult], None] | None = None, device: str = "cpu",
                 profile: Path | None = None) -> list[CodecResult]:
    dev = torch.device(device)
    finish = waiter(dev)
    results = []
    profiles: list[str] = []
    for name, host in inputs.items():
        x = host.to(dev)
        clone_s, _ = median_time(lambda: x.clone(), repeats, finish)
        clone_kernels_s = kernel_seconds(lambda: x.clone(), dev)
        onto = dev if dev.type != "cpu" else None
        for spec in specs:
            pipe = Pipeline(spec)
            encode_s, payload = median_time(lambda: pipe.encode_parts([x]), repeats, finish)
            assert isinstance(payload, (bytes, memoryview))
            decode_s, decoded = median_time(lambda: pipe.decode(payload, x.numel(), onto).dense(x.numel()), repeats,
                                            finish)
            assert isinstance(decoded, torch.Tensor)
            err = float((host - decoded.cpu()).norm() / host.norm().clamp(min=1e-30))
            to_host_s = to_device_s = 0.0
            if onto is not None:
                staged = torch.empty(len(payload), dtype=torch.uint8, device=dev)
                pinned = torch.empty(len(payload), dtype=torch.uint8, pin_memory=True)
                to_host_s, _ = median_time(lambda: pinned.copy_(staged), repeats, finish)
                arrived = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                to_device_s, _ = median_time(lambda: arrived.to(dev), repeats, finish)
            r = CodecResult(pipe.name, name, x.numel(), 8 * len(payload) / x.numel(), err, encode_s, decode_s, clone_s,
                            str(dev), to_host_s, to_device_s, kernel_seconds(lambda: pipe.encode_parts([x]), dev),
                            kernel_seconds(lambda: pipe.decode(payload, x.numel(), onto), dev), clone_kernels_s)
            results.append(r)
            if profile is not None:
                profiles.append(f"# {pipe.name} on {name}: encode\n\n" + profile_tables(lambda: pipe.encode_parts([x]), dev))
                profiles.append(f"# {pipe.name} on {name}: decode\n\n" + profile_tables(
                    lambda: pipe.decode(payload, x.numel(), onto).dense(x.numel()), dev))
            if progress is not None:
                progress(r)
    if profile is not None:
        profile.parent.mkdir(parents=True, exist_ok=True)
        profile.write_text("\n\n".join(profiles))
    return results


def write_json(results: list[CodecResult], path: str | Path, meta: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps({"meta": meta, "results": [r.row() for r in results]}, indent=2) + "\n")


def markdown_table(results: list[CodecResult]) -> str:
    device = any(r.to_host_s for r in results)
    extra = (" its bytes to host ×clone | encode less that ×clone | its bytes to device ×clone | decode less that "
             "×clone | encode's kernels ×clone's | decode's kernels ×clone's |") if device else ""
    lines = ["| pipeline | input | bits/param | rel. L2 error | encode ×clone | decode ×clone | encode GB/s |" + extra,
             "|---|---|---|---|---|---|---|" + ("---|---|---|---|---|---|" if device else "")]
    for r in results:
        more = (f" {r.to_host_s / r.clone_s:.1f} | {r.on_device_x:.1f} | {r.to_device_s / r.clone_s:.1f} | "
                f"{r.decode_on_device_x:.1f} | {r.kernels_x(r.encode_kernels_s):.1f} | "
                f"{r.kernels_x(r.decode_kernels_s):.1f} |") if device else ""
        lines.append(f"| `{r.spec}` | {r.input} | {r.bits_per_param:.4f} | {r.rel_l2_error:.4f} | "
                     f"{r.encode_x:.1f} | {r.decode_x:.1f} | {r.encode_gbps:.2f} |" + more)
    return "\n".join(lines)
