"""What the server sees: per document, the head's output (input side) and the trunk's output
(output side) at every requested split depth, computed with Veil's own layer code.

The auditor holds the whole public model: a :class:`ClientModel` for the tokenizer, embedding,
final norm and LM head, plus one :class:`LayerStack` per decoder layer so a single pass over a
document yields the hidden state after every layer. For a symmetric split with k local layers
the server receives the state after layer k and returns the state after layer n - k.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.audit.corpus import Document
from engine.chat import messages_for, prompt_ids
from engine.loading import ResolvedModel
from engine.model import LayerStack, LayerWeights
from engine.split import ClientModel, SplitPlan, read_layers


class AuditModel:
    """The public model, split into per-layer stacks."""

    def __init__(self, resolved: ResolvedModel, dtype: torch.dtype = torch.float32) -> None:
        from engine.loading import load_config

        config = load_config(resolved.folder)
        self.client = ClientModel(resolved, SplitPlan.symmetric(config.n_layers, 1), dtype=dtype)
        self.config = config
        self.n_layers = config.n_layers
        self.tokenizer = self.client.tokenizer
        self.layers: dict[int, LayerWeights] = read_layers(
            self.client.reader, config, range(config.n_layers), dtype, "cpu"
        )
        self.stacks = [
            LayerStack(config, i, [self.layers[i]], dtype=dtype) for i in range(self.n_layers)
        ]
        # the rows the first layer sees (Gemma scales them by sqrt(H)): what an attacker who
        # replays candidate tokens through the public layers feeds them
        self.embed_weight = self.client.embed_weight  # [V, H]
        if config.embed_scale != 1.0:
            self.embed_weight = self.client.embed(torch.arange(config.vocab_size))

    def stack(self, start: int, end: int) -> LayerStack:
        """A fresh stack of the public layers [start, end) with its own cache."""
        return LayerStack(self.config, start, [self.layers[i] for i in range(start, end)])

    def reset(self) -> None:
        for s in self.stacks:
            s.reset()

    @torch.inference_mode()
    def states(
        self, ids: Sequence[int], keep_layers: Sequence[int], logits: bool = True
    ) -> dict[int, torch.Tensor]:
        """Hidden state [T, H] after each layer in ``keep_layers`` (0 = embedding) and the
        final logits under key -1 ([T, V])."""
        self.reset()
        ids_t = torch.tensor(list(ids), dtype=torch.long)  # [T]
        pos = torch.arange(len(ids))  # [T]
        x = self.client.embed(ids_t)  # [T, H]
        out: dict[int, torch.Tensor] = {}
        if 0 in keep_layers:
            out[0] = x.clone()
        for i, s in enumerate(self.stacks):
            x = s.forward(x, pos)  # [T, H]
            if i + 1 in keep_layers:
                out[i + 1] = x.clone()
        if logits:
            out[-1] = self.client.logits(x)  # [T, V]
        self.reset()
        return out

    @torch.inference_mode()
    def greedy(self, ids: Sequence[int], max_new: int) -> list[int]:
        """Greedy continuation of ``ids`` (stops at EOS)."""
        self.reset()
        eos = set(self.config.eos_token_ids)
        x = self.client.embed(torch.tensor(list(ids)))  # [T, H]
        pos = torch.arange(len(ids))  # [T]
        new: list[int] = []
        for _ in range(max_new):
            for s in self.stacks:
                x = s.forward(x, pos)
            tok = int(self.client.logits(x[-1:]).argmax(-1))
            if tok in eos:
                break
            new.append(tok)
            x = self.client.embed(torch.tensor([tok]))  # [1, H]
            pos = torch.tensor([len(ids) + len(new) - 1])  # [1]
        self.reset()
        return new


def add_generated_replies(
    model: AuditModel, docs: Sequence[Document], max_new: int, max_prompt: int
) -> None:
    """Turn prompt documents into chat prompt (at most ``max_prompt`` tokens) + the model's
    greedy reply (at most ``max_new`` tokens)."""
    tok = model.tokenizer
    for d in docs:
        ids = prompt_ids(tok, messages_for(d.text))[:max_prompt]
        reply = model.greedy(ids, max_new)
        d.generated_from = len(ids)
        # PII marks of the prompt: tokenise the prompt text alone and find it in the template.
        enc = tok(d.text, return_offsets_mapping=True, add_special_tokens=False)
        mask_text = [
            any(s < e2 and s2 < e for s2, e2, _ in d.pii) for s, e in enc["offset_mapping"]
        ]
        text_ids = [int(i) for i in enc["input_ids"]]
        mask = [False] * len(ids)
        for j in range(len(ids) - len(text_ids) + 1):
            if ids[j : j + len(text_ids)] == text_ids:
                mask[j : j + len(text_ids)] = mask_text
                break
        d.ids = ids + reply
        d.pii_mask = mask + [False] * len(reply)
        d.text = d.text + "\n" + tok.decode(reply)


def collect(
    model: AuditModel,
    docs: Sequence[Document],
    layers: Sequence[int],
    progress: Callable[[float], None] | None = None,
    logits: bool = True,
) -> tuple[dict[int, list[torch.Tensor]], list[torch.Tensor]]:
    """States after each of ``layers`` for every document, and the public model's top-5
    next-token predictions per position ([T, 5]) — what the public tail + LM head give."""
    states: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    top5: list[torch.Tensor] = []
    for n, d in enumerate(docs):
        out = model.states(d.ids, layers, logits)
        for layer in layers:
            states[layer].append(out[layer])
        if logits:
            top5.append(out[-1].topk(5, dim=-1).indices)  # [T, 5]
        if progress:
            progress((n + 1) / len(docs))
    return states, top5


@torch.inference_mode()
def logits_from(model: AuditModel, layer: int, hidden: torch.Tensor) -> torch.Tensor:
    """Run the public layers [layer, n) + norm + LM head on a whole sequence's state [T, H]."""
    model.reset()
    pos = torch.arange(hidden.shape[0])  # [T]
    x = hidden
    for s in model.stacks[layer:]:
        x = s.forward(x, pos)  # [T, H]
    model.reset()
    return model.client.logits(x)  # [T, V]
