"""Fine-tuning scenario trainings: small, real, seeded PyTorch runs of a causal language model on
variable-length text, where what goes wrong is only visible inside the job -- a data-preparation bug in
the batch collation, and LoRA adapters cut off from the gradient -- instrumented with the TrainGuard SDK
like ``tests/scenarios/trainings.py`` (its ``_start``/``_step``: ``trainguard.init()`` from the
environment, ``trainguard.watch()``, ``trainguard.log()`` after each optimizer step) plus the two helpers
for what only the job can see: ``trainguard.check_batch()`` on each collated batch and
``trainguard.watch_lora()``.

    python -m tests.scenarios.trainings_finetune <scenario> [--seed N] [--debug]

The data: "sentences" of words drawn from a fixed random Markov chain over a 40-word vocabulary (each word
is followed by one of 3 words), of random length (4 to 40 words, most of them short), turned into ids by a
tiny word tokenizer (``<pad>`` = 0, ``<eos>`` = 1) that appends ``<eos>``. The model: a 2-block causal
transformer (``FinetuneLM``) with an attention mask over the keys (padding), written out so that a
mask's effect is exactly what the collator asked for. LoRA (``LoraLinear``): peft's layout and parameter
names (``q_proj.base_layer``, ``q_proj.lora_A.default.weight``, ``q_proj.lora_B.default.weight``; B
initialised to 0), on the q/v projections and the MLP's up projection of every block; the base model
(embeddings, blocks) is frozen, the LM head trains with the adapters (peft's ``modules_to_save``).

Nothing is injected: every anomaly is a bug in the data preparation or the training setup.

============  ==========================================================================================
scenario      what really happens
============  ==========================================================================================
truncation    Full fine-tune (every parameter trains). The collator was written for right padding: it
              builds the attention mask from the sentences' token counts taken before truncation
              (``arange(24) < length``), while the tokenizer it shares with the evaluation code pads on
              the *left* (``padding_side="left"``, set for batched generation) and truncates on the right
              after ``<eos>`` was appended. Short rows: the mask attends the leading pads and masks the
              end of the sentence (the labels follow the mask: the loss is computed on padding); long
              rows: ``<eos>`` cut off. The loss still falls (the model learns to predict padding).
              ``check_batch`` every 2 batches.
lora_break    LoRA fine-tune, two phases as in long-context training: steps 0-23 at context 16, then
              context 32 with gradient checkpointing of each block (to fit memory) through
              ``torch.utils.checkpoint.checkpoint(block, ..., use_reentrant=True)``. The embeddings are
              frozen, so the checkpointed segment's input does not require grad and the reentrant
              checkpoint's output is detached from the adapters: from step 24 on every adapter parameter
              gets no gradient (``.grad`` is None) -- the well-known missing
              ``model.enable_input_require_grads()`` -- while the trainable LM head keeps the loss
              falling. ``watch_lora`` every 2 steps, ``check_batch`` (correct batches) every 4.
healthy_lora  The same fine-tune done right: the embedding output is made to require grad (what
              ``enable_input_require_grads`` does, a forward hook), so the adapters keep learning through
              the checkpointed blocks; correct collation (right padding, mask from the truncated ids,
              ``<eos>`` kept by truncating the words to 23 before appending it, labels -100 on pads),
              checked every 4 batches. Minibatch noise, LR warmup then cosine decay, clip 1.0.
============  ==========================================================================================
"""

from __future__ import annotations

import math
import os
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import trainguard
from tests.scenarios.trainings import _set_lr, _start, _step, _warmup_cosine, scenario_args

SCENARIOS = ("truncation", "lora_break", "healthy_lora")
PAD, EOS, UNK = 0, 1, 2
WORDS = 40
MAX_LEN = 24
_DEBUG = bool(os.environ.get("SCENARIO_DEBUG"))


# --- data: a Markov chain of words and a tiny tokenizer ---------------------------------------------------
class WordTokenizer:
    """Word-level tokenizer: ``<pad>`` 0, ``<eos>`` 1, ``<unk>`` 2, then the words ``w0`` .. ``w{n-1}``."""

    def __init__(self, words: int, padding_side: str = "right") -> None:
        self.vocab: Dict[str, int] = {"<pad>": PAD, "<eos>": EOS, "<unk>": UNK}
        for i in range(words):
            self.vocab[f"w{i}"] = len(self.vocab)
        self.pad_token_id, self.eos_token_id = PAD, EOS
        self.padding_side = padding_side

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, add_eos: bool = True) -> List[int]:
        ids = [self.vocab.get(word, UNK) for word in text.split()]
        return [*ids, EOS] if add_eos else ids

    def pad(self, rows: Sequence[List[int]], length: int) -> torch.Tensor:
        """``rows`` (each at most ``length`` ids) padded with ``<pad>`` on ``padding_side``."""
        out = torch.full((len(rows), length), PAD, dtype=torch.long)
        for i, row in enumerate(rows):
            if self.padding_side == "left":
                out[i, length - len(row):] = torch.tensor(row, dtype=torch.long)
            else:
                out[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        return out


class MarkovText:
    """Sentences from a fixed random Markov chain over ``WORDS`` words (each followed by one of 3), of
    length 4 + an exponential draw of mean 8 words, at most ``most``: mostly short, some long."""

    def __init__(self, gen: torch.Generator, most: int = 40) -> None:
        self.gen, self.most = gen, most
        self.transitions = torch.zeros(WORDS, WORDS)
        for w in range(WORDS):
            self.transitions[w, torch.randperm(WORDS, generator=gen)[:3]] = torch.tensor([0.6, 0.3, 0.1])

    def sample(self, count: int) -> List[str]:
        out = []
        for _ in range(count):
            u = float(torch.rand(1, generator=self.gen))
            n = min(self.most, 4 + int(-8.0 * math.log(1.0 - u)))
            words = [int(torch.randint(WORDS, (1,), generator=self.gen))]
            for _ in range(n - 1):
                words.append(int(torch.multinomial(self.transitions[words[-1]], 1, generator=self.gen)))
            out.append(" ".join(f"w{w}" for w in words))
        return out


Batch = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # ids, attention mask, labels


def collate(tok: WordTokenizer, texts: Sequence[str], max_length: int = MAX_LEN) -> Batch:
    """Correct: right padding; keep ``<eos>`` (truncate the words to max_length - 1 first); the mask from
    the ids as they are; labels -100 where the mask is 0."""
    rows = [[*tok.encode(t, add_eos=False)[: max_length - 1], EOS] for t in texts]
    ids = tok.pad(rows, max_length)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        if tok.padding_side == "left":
            mask[i, max_length - len(row):] = 1
        else:
            mask[i, :len(row)] = 1
    return ids, mask, ids.masked_fill(mask == 0, -100)


def collate_buggy(tok: WordTokenizer, texts: Sequence[str], max_length: int = MAX_LEN) -> Batch:
    """The bug: written for right padding, the mask is built from the token counts taken before truncation;
    the shared tokenizer pads on the left, and truncation after ``<eos>`` cuts it off long rows."""
    encoded = [tok.encode(t) for t in texts]                  # ... + <eos>
    lengths = torch.tensor([len(e) for e in encoded])         # counted before truncation
    ids = tok.pad([e[:max_length] for e in encoded], max_length)  # right truncation; tokenizer's padding side
    mask = (torch.arange(max_length).unsqueeze(0) < lengths.unsqueeze(1)).long()  # right-padding mask
    return ids, mask, ids.masked_fill(mask == 0, -100)


# --- model: a small causal transformer, optionally with LoRA ------------------------------------------------
class LoraLinear(nn.Module):
    """peft's LoRA layer layout: ``base_layer`` + ``lora_A``/``lora_B`` ModuleDicts keyed by adapter name."""

    def __init__(self, base: nn.Linear, r: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, base.out_features, bias=False)})
        nn.init.kaiming_uniform_(self.lora_A["default"].weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B["default"].weight)
        self.scaling = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        delta = self.lora_B["default"](self.lora_A["default"](x)) * self.scaling
        return self.base_layer(x) + delta  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.o_proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.up_proj: nn.Module = nn.Linear(dim, 2 * dim)
        self.down_proj = nn.Linear(2 * dim, dim)

    def forward(self, h: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        x = self.ln1(h)
        q, k, v = (p(x).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
        h = h + self.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))
        return h + self.down_proj(torch.relu(self.up_proj(self.ln2(h))))  # type: ignore[no-any-return]


class FinetuneLM(nn.Module):
    """Causal LM; ``attention_mask`` (1 = attend) masks keys; a position always sees itself (no empty
    softmax rows). ``checkpointing`` runs each block under ``torch.utils.checkpoint`` (reentrant)."""

    def __init__(self, vocab: int, context: int = 32, dim: int = 48, heads: int = 4, blocks: int = 2) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.embed_positions = nn.Embedding(context, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(blocks))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab)
        self.checkpointing = False

    def add_lora(self, r: int = 4) -> None:
        for block in self.layers:
            assert isinstance(block, Block)
            block.q_proj = LoraLinear(block.q_proj, r)  # type: ignore[assignment]
            block.v_proj = LoraLinear(block.v_proj, r)  # type: ignore[assignment]
            block.up_proj = LoraLinear(block.up_proj, r)  # type: ignore[assignment]

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        t, device = ids.shape[1], ids.device
        h = self.embed_tokens(ids) + self.embed_positions(torch.arange(t, device=device))
        causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
        allowed = (causal & attention_mask.bool().unsqueeze(1)) | torch.eye(t, dtype=torch.bool, device=device)
        for block in self.layers:
            if self.checkpointing:
                h = checkpoint(block, h, allowed, use_reentrant=True)
            else:
                h = block(h, allowed)
        return self.lm_head(self.norm(h))  # type: ignore[no-any-return]


def _lm_loss(model: FinetuneLM, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(ids, mask)
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                       labels[:, 1:].reshape(-1), ignore_index=-100)


def _debug(step: int, loss: torch.Tensor, model: nn.Module) -> None:
    if not _DEBUG:
        return
    a = [p.grad.abs().mean().item() for n, p in model.named_parameters() if "lora_A" in n and p.grad is not None]
    b = [p.grad.abs().mean().item() for n, p in model.named_parameters() if "lora_B" in n and p.grad is not None]
    print(f"{step:4d} loss {loss.item():.5g} lora A {sum(a) / max(1, len(a)):.3g} ({len(a)}) "
          f"B {sum(b) / max(1, len(b)):.3g} ({len(b)})", file=sys.stderr)


# --- scenarios ---------------------------------------------------------------------------------------------
def truncation(steps: int = 80, seed: int = 0) -> None:
    torch.manual_seed(seed)
    text = MarkovText(torch.Generator().manual_seed(21 + 1000 * seed))
    tok = WordTokenizer(WORDS, padding_side="left")  # set for batched generation in the evaluation code
    model = FinetuneLM(len(tok))
    base_lr = 3e-3
    optimizer = torch.optim.AdamW(model.parameters(), lr=base_lr, weight_decay=0.01)
    _start("truncation", model, optimizer, clip=1.0)
    for step in range(steps):
        _set_lr(optimizer, base_lr * _warmup_cosine(step, 10, steps))
        ids, mask, labels = collate_buggy(tok, text.sample(16))
        trainguard.check_batch(ids, mask, labels=labels, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id,
                               max_length=MAX_LEN, every=2)
        loss = _lm_loss(model, ids, mask, labels)
        _step(model, optimizer, loss, step, clip=1.0)
        _debug(step, loss, model)


def _lora_finetune(name: str, fixed: bool, steps: int = 80, seed: int = 0, switch: int = 24) -> None:
    torch.manual_seed(seed)
    text = MarkovText(torch.Generator().manual_seed(22 + 1000 * seed))
    tok = WordTokenizer(WORDS)
    model = FinetuneLM(len(tok))
    model.requires_grad_(False)  # the "pretrained" base is frozen
    model.add_lora()
    model.lm_head.requires_grad_(True)  # trained with the adapters (peft's modules_to_save)
    if fixed:  # what transformers' enable_input_require_grads() does
        model.embed_tokens.register_forward_hook(lambda _m, _i, out: out.requires_grad_(True))
    trainable = [p for p in model.parameters() if p.requires_grad]
    base_lr = 3e-3
    optimizer = torch.optim.AdamW(trainable, lr=base_lr, weight_decay=0.0)
    _start(name, model, optimizer, clip=1.0)
    trainguard.watch_lora(model, every=2)
    for step in range(steps):
        _set_lr(optimizer, base_lr * _warmup_cosine(step, 10, steps))
        length = 16 if step < switch else 32  # sequence-length warmup, then long context ...
        model.checkpointing = step >= switch  # ... with activation checkpointing to fit it
        ids, mask, labels = collate(tok, text.sample(16), max_length=length)
        trainguard.check_batch(ids, mask, labels=labels, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id,
                               max_length=length, every=4)
        loss = _lm_loss(model, ids, mask, labels)
        _step(model, optimizer, loss, step, clip=1.0)
        _debug(step, loss, model)


def lora_break(steps: int = 80, seed: int = 0) -> None:
    _lora_finetune("lora_break", fixed=False, steps=steps, seed=seed)


def healthy_lora(steps: int = 80, seed: int = 0) -> None:
    _lora_finetune("healthy_lora", fixed=True, steps=steps, seed=seed)


RUNNERS: Dict[str, Callable[..., None]] = {
    "truncation": truncation, "lora_break": lora_break, "healthy_lora": healthy_lora,
}


def main(argv: Optional[List[str]] = None) -> None:
    global _DEBUG
    args = scenario_args(__doc__, SCENARIOS, "print loss and adapter gradients per step", argv)
    _DEBUG = _DEBUG or args.debug
    RUNNERS[args.scenario](seed=args.seed)


if __name__ == "__main__":
    main()
