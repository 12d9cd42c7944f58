"""CUDA-error wordings the classifier missed (issue 17, stop 40, from tuned pastes added by 6325b8f):

* a kernel assertion whose own text holds backticks -- torch.multinomial's ``Assertion `probability tensor
  contains either `inf`, `nan` or element < 0` failed.`` (``mem-device-assert-multinomial-probability-grpo-
  trl-3035-1``, huggingface/trl#3035);
* a CUDA extension op's own check, ``error in ms_deformable_col2im_cuda: an illegal memory access was
  encountered`` (``mem-illegal-address-deform-col2im-indented-mmdet-7186-1``, open-mmlab/mmdetection#7186),
  read only when the reason is the CUDA runtime's string for a device fault or a missing kernel image;
* (from 755361d's tuned paste) a kernel assertion whose backticks markdown ate, read only right after the
  kernel site's ``thread: [..]``.

The pasted lines are read from the fixtures (verbatim); lines written here are marked SYNTHETIC."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard_engine.classify import classify_text

WILD = Path(__file__).resolve().parents[1] / "fixtures" / "wild"


def _first_line(case: str, needle: str) -> str:
    lines = (WILD / case / "log.txt").read_text(encoding="utf-8").splitlines()
    return next(line for line in lines if needle in line)


def test_a_kernel_assertion_holding_backticks_is_a_device_side_assert() -> None:
    line = _first_line("mem-device-assert-multinomial-probability-grpo-trl-3035-1", "Assertion `")
    found = classify_text(line)
    assert found is not None and (found.kind, found.rule) == ("memory/cuda-error", "cuda.device-assert")
    assert found.facts["assertion"] == "probability tensor contains either `inf`, `nan` or element < 0"
    assert found.facts["kernel"] == "_assert_async_cuda_kernel"
    assert found.facts["index_out_of_range"] is False


@pytest.mark.parametrize("line, assertion", [
    # SYNTHETIC forms of the same site: the plain assertion, and one wrapped before its 'failed.'
    ("../aten/src/ATen/native/cuda/Indexing.cu:1308: indexSelectLargeIndex: block: [56,0,0], thread: [0,0,0] "
     "Assertion `srcIndex < srcSelectDimSize` failed.", "srcIndex < srcSelectDimSize"),
    ("../aten/src/ATen/native/cuda/TensorCompare.cu:110: _assert_async_cuda_kernel: block: [0,0,0], thread: "
     "[0,0,0] Assertion `probability tensor contains either `inf`, `nan` or element < 0`\nfailed.",
     "probability tensor contains either `inf`, `nan` or element < 0"),
])
def test_the_assertion_is_the_shortest_text_its_closing_backtick_ends(line: str, assertion: str) -> None:
    found = classify_text(line)
    assert found is not None and found.rule == "cuda.device-assert"
    assert found.facts["assertion"] == assertion


def test_an_extension_ops_own_cuda_error_line_is_a_cuda_error() -> None:
    line = _first_line("mem-illegal-address-deform-col2im-indented-mmdet-7186-1", "error in ")
    found = classify_text(line)
    assert found is not None and (found.kind, found.rule) == ("memory/cuda-error", "cuda.error")
    assert found.facts == {"error": "an illegal memory access was encountered",
                           "error_class": "illegal-memory-access", "op": "ms_deformable_col2im_cuda"}


def test_a_missing_kernel_image_in_an_extension_op_is_a_cuda_error() -> None:
    # SYNTHETIC: DCNv2's wording of the same check when the op was built for another GPU architecture
    found = classify_text("error in modulated_deformable_im2col_cuda: no kernel image is available for "
                          "execution on the device")
    assert found is not None and found.kind == "memory/cuda-error"
    assert found.facts["error_class"] == "no-kernel-image"


def test_a_kernel_assertion_whose_backticks_markdown_ate_is_a_device_side_assert() -> None:
    # mem-device-assert-no-backticks-quoted-megatron-ds-239-1 (tuned, deepspeedai/Megatron-DeepSpeed#239, added
    # by 755361d): '> '-quoted 'thread: [124,0,0] Assertion srcIndex < srcSelectDimSize failed.'
    line = _first_line("mem-device-assert-no-backticks-quoted-megatron-ds-239-1", "Assertion ")
    found = classify_text(line)
    assert found is not None and found.rule == "cuda.device-assert"
    assert found.facts["assertion"] == "srcIndex < srcSelectDimSize"
    assert found.facts["index_out_of_range"] is True


@pytest.mark.parametrize("line, rule", [
    # SYNTHETIC: 'error in x: ...' whose reason is not the CUDA runtime's string for a device fault
    ("error in ms_deformable_im2col_cuda: invalid configuration argument", "cuda.error"),
    ("error in parse_config: unexpected key 'lr'", "cuda.error"),
    ("Error in sys.excepthook: illegal memory access", "cuda.error"),
    # SYNTHETIC: a bare 'Assertion ... failed' that is not a kernel's site line
    ("[rank0] Assertion x failed", "cuda.device-assert"),
    ("foo.cpp:12: bar: [x] Assertion y failed.", "cuda.device-assert"),
    ("python: ../src/thing.c:33: main: Assertion `n > 0' failed.", "cuda.device-assert"),
])
def test_look_alikes_are_not_read_by_those_rules(line: str, rule: str) -> None:
    found = classify_text(line)
    assert found is None or (found.rule != rule and found.kind != "memory/cuda-error")
