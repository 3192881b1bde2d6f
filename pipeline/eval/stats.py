"""The estimators of an evaluation, as small pure functions (their intervals: pipeline/eval/intervals.py).

pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1): of n samples
of a prompt, c correct, the unbiased estimate of "at least one of k draws is correct" is
1 - C(n-c, k) / C(n, k); computed as the paper's stable product 1 - prod_{i=n-c+1}^{n} (1 - k/i),
which never forms the binomials (C(1024, 512) overflows a float). maj@k is an expectation over
k-subsets, as pass@k is (maj_at_k), over answers clustered as the accuracy reward compares them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import numpy as np

def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k): the chance that k of the n samples, drawn without replacement, hold a correct one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


INVALID = "[invalid]"
"""What a sample without an answer votes for (lm-evaluation-harness's filter): one answer of its own."""
MAJ_SUBSETS = 5000
"""maj@k is exact over the k-subsets up to this many of them; above, this many seeded draws (MAJ_SEED)."""
MAJ_SEED = 0


def clusters(answers: Sequence[str | None], same: Callable[[str, str], bool],
             key: Callable[[str], object] | None = None) -> np.ndarray:
    """Each sample's answer as a cluster number [n], numbered in order of first appearance: answers equal as
    `same` says are one cluster, and every sample without an answer (None) is the one cluster INVALID.

    `key` (optional) is a shortcut `same` must agree with: two answers with keys (not None) are the
    same answer exactly when their keys are equal, so they are never compared with `same`. Without
    it 1024 distinct answers take half a million math-verify calls (minutes per prompt)."""
    reps: list[int] = []  # a cluster's first sample
    rep_keys: list[object] = []  # the key of a cluster's first sample (None: it has none)
    keyed: dict[object, int] = {}  # key -> its cluster
    invalid: int | None = None
    out = np.zeros(len(answers), dtype=np.int64)
    for i, a in enumerate(answers):
        if a is None:
            if invalid is None:
                invalid = len(reps)
                reps.append(i)
                rep_keys.append(INVALID)  # never compared with an answer
            out[i] = invalid
            continue
        kk = key(a) if key is not None else None
        if kk is not None and kk in keyed:
            out[i] = keyed[kk]
            continue
        for j, r in enumerate(reps):
            if rep_keys[j] is INVALID or (kk is not None and rep_keys[j] is not None):
                continue  # the invalid cluster, or two keyed answers whose keys differ: two answers
            if same(answers[r], a):
                break
        else:
            j = len(reps)
            reps.append(i)
            rep_keys.append(kk)
        out[i] = j
        if kk is not None:
            keyed[kk] = j
    return out


def majority(answers: Sequence[str | None], same: Callable[[str, str], bool],
             key: Callable[[str], object] | None = None) -> int | None:
    """The index of the first sample of the most common answer (clusters: a sample without one votes
    INVALID; a tie goes to the answer seen first), or None when there are no samples."""
    if not answers:
        return None
    labels = clusters(answers, same, key)
    counts = np.bincount(labels)
    return int(np.argmax(np.isin(labels, np.flatnonzero(counts == counts.max()))))


@functools.lru_cache(maxsize=16)
def _subsets(n: int, k: int, seed: int) -> np.ndarray:
    """Every k-subset of range(n) (C(n, k) <= MAJ_SUBSETS), else MAJ_SUBSETS drawn with `seed`: the same for
    every prompt of a record (its samples are exchangeable), drawn once."""
    import itertools

    if math.comb(n, k) <= MAJ_SUBSETS:
        return np.array(list(itertools.combinations(range(n), k)), dtype=np.int64).reshape(-1, k)
    rng = np.random.default_rng(seed)
    return np.sort(np.argsort(rng.random((MAJ_SUBSETS, n)), axis=1)[:, :k], axis=1)


def maj_at_k(labels: np.ndarray, hits: np.ndarray, k: int, seed: int = MAJ_SEED) -> np.ndarray:
    """maj@k as its expectation over the k-subsets of the n samples, as pass@k is: the share of k-subsets
    whose majority answer (a tie: the answer seen first in the subset; INVALID votes as one answer) is
    correct, a cluster's correctness being its first sample's in the subset (so maj@1 is pass@1 exactly).
    Exact over all C(n, k) subsets up to MAJ_SUBSETS, else MAJ_SUBSETS subsets drawn with `seed`.

    labels, hits [..., n] (cluster numbers < n, 0/1): vectorised over leading axes (prompts, records)."""
    labels, hits = np.asarray(labels), np.asarray(hits, dtype=np.float64)
    n = labels.shape[-1]
    if not 1 <= k <= n:
        raise ValueError(f"maj@k needs 1 <= k <= n (n={n}, k={k})")
    subsets = _subsets(n, k, seed)  # [S, k], positions ascending
    lead = labels.shape[:-1]
    lab = labels.reshape(-1, n)  # [P, n]
    hit = hits.reshape(-1, n)
    S = len(subsets)
    out = np.empty(lab.shape[0])
    step = max(1, 4_000_000 // (S * n))  # prompts at a time: [chunk, S, n] counts
    for i in range(0, lab.shape[0], step):
        sub = lab[i:i + step][:, subsets]  # [P, S, k]: each subset's cluster numbers
        P = sub.shape[0]
        flat = (np.arange(P * S).reshape(P, S, 1) * n + sub).ravel()
        counts = np.bincount(flat, minlength=P * S * n).reshape(P, S, n)  # [P, S, clusters]
        top = counts == counts.max(axis=2, keepdims=True)  # [P, S, clusters]: the largest clusters
        first = np.argmax(np.take_along_axis(top, sub, axis=2), axis=2)  # [P, S]: the first position voting for one
        pos = subsets[np.arange(S)[None, :], first]  # [P, S]: that sample
        out[i:i + P] = np.take_along_axis(hit[i:i + P], pos, axis=1).mean(axis=1)
    return out.reshape(lead)
