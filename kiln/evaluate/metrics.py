"""Scores from log-likelihoods, as lm-evaluation-harness 0.4 computes and aggregates them.

multiple choice, per item (its ConfigurableTask.process_results):
    acc       1 when argmax_i ll_i is the gold choice; the first maximum wins on ties (np.argmax)
    acc_norm  the same with ll_i / len(choice_i), the choice's length in characters (its completion_len: the
              choice without the leading space; len of a Python str counts code points, so "é" is 1)
aggregated (its `mean` aggregation and `mean_stderr`, the closed form it uses for a mean):
    acc = Σ acc / n,   acc_stderr = sqrt(Σ (acc - mean)² / (n - 1)) / sqrt(n)   ("N/A" for n = 1)

perplexity, per document (its loglikelihood_rolling process_results): (ll, words), (ll, bytes) with words =
len(re.split(r"\\s+", text)) and bytes the UTF-8 length; aggregated by its weighted_perplexity and bits_per_byte:
    word_perplexity = exp(-Σ ll / Σ words)     byte_perplexity = exp(-Σ ll / Σ bytes)
    bits_per_byte = -Σ ll / Σ bytes / ln 2     (the harness reports no standard error for these: "N/A")
"""
from __future__ import annotations

import math
import re

import numpy as np

NA = "N/A"  # the harness's value for a standard error it does not compute


def choice_scores(lls, choices, gold: int) -> tuple[float, float]:
    """(acc, acc_norm) of one item from its choices' log-likelihoods."""
    lls = np.asarray(lls, dtype=np.float64)
    lengths = np.array([float(len(c)) for c in choices])
    with np.errstate(divide="ignore", invalid="ignore"):  # an empty choice: ll / 0 = -inf, as in the harness
        normed = lls / lengths
    return float(np.argmax(lls) == gold), float(np.argmax(normed) == gold)


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def mean_stderr(values: list[float]) -> float | str:
    """The standard error of the mean with the sample standard deviation (Bessel's n - 1); N/A for one value."""
    if len(values) < 2:
        return NA
    mu = mean(values)
    return math.sqrt(sum((x - mu) ** 2 for x in values) / (len(values) - 1)) / math.sqrt(len(values))


def multiple_choice_results(per_item: list[tuple[float, float]]) -> dict:
    """The harness's results entry for a multiple-choice task: acc, acc_norm and their standard errors."""
    acc = [a for a, _ in per_item]
    norm = [n for _, n in per_item]
    return {"acc,none": mean(acc), "acc_stderr,none": mean_stderr(acc),
            "acc_norm,none": mean(norm), "acc_norm_stderr,none": mean_stderr(norm)}


def count_words(text: str) -> int:
    return len(re.split(r"\s+", text))


def count_bytes(text: str) -> int:
    return len(text.encode("utf-8"))


def weighted_mean(pairs: list[tuple[float, int]]) -> float:
    return sum(a for a, _ in pairs) / sum(b for _, b in pairs)


def perplexity_results(lls: list[float], texts: list[str]) -> dict:
    """The harness's results entry for a loglikelihood_rolling task."""
    words = [(ll, count_words(t)) for ll, t in zip(lls, texts)]
    nbytes = [(ll, count_bytes(t)) for ll, t in zip(lls, texts)]
    return {"word_perplexity,none": math.exp(-weighted_mean(words)), "word_perplexity_stderr,none": NA,
            "byte_perplexity,none": math.exp(-weighted_mean(nbytes)), "byte_perplexity_stderr,none": NA,
            "bits_per_byte,none": -weighted_mean(nbytes) / math.log(2), "bits_per_byte_stderr,none": NA}
