"""How owners combine contributions: per-coordinate sparse means and a canonical summation order."""

from __future__ import annotations

import itertools

import pytest
import torch

from diloco.comms.reduce import average, canonical_order
from diloco.compression import Pipeline
from diloco.compression.pipeline import Decoded

pytestmark = pytest.mark.unit


def test_sparse_mean_is_per_coordinate_over_the_peers_that_sent_it():
    a = Decoded(torch.tensor([0, 2]), torch.tensor([1.0, 4.0]))
    b = Decoded(torch.tensor([2, 3]), torch.tensor([2.0, 6.0]))
    dense = Decoded(None, torch.tensor([3.0, 3.0, 3.0, 3.0, 3.0]))
    assert average([a, b], 5).tolist() == [1.0, 0.0, 3.0, 6.0, 0.0]  # coordinate 2: (4+2)/2; 1 and 4: nobody
    assert average([a, b, dense], 5).tolist() == [2.0, 3.0, 3.0, 4.5, 3.0]
    assert average([dense, dense], 5).tolist() == [3.0] * 5


def test_canonical_order_makes_the_sum_independent_of_arrival_order():
    g = torch.Generator().manual_seed(3)
    pipe = Pipeline("fp32")
    payloads = [pipe.encode(torch.randn(20_000, generator=g) * 10 ** i) for i in range(4)]  # mixed magnitudes
    results, naive = set(), set()
    for perm in itertools.permutations(payloads):
        parts = [pipe.decode(p, 20_000) for p in perm]
        results.add(average([parts[i] for i in canonical_order(perm)], 20_000).numpy().tobytes())
        naive.add(average(parts, 20_000).numpy().tobytes())
    assert len(results) == 1
    assert len(naive) > 1  # without it, float addition order shows in the bits
