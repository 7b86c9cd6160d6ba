"""An EAGLE-style draft: one decoder layer that reads the target's hidden states.

A standalone draft must rebuild from tokens alone what the target already computed; a layer
fed the target's last hidden state only has to extrapolate it by one token, which is why EAGLE
drafts agree with their targets far more often at the same cost. At position t the input is
[embedding(x_t), h_{t-1}], where h_{t-1} is the target's final (normed) hidden state at t-1;
the output is the draft's guess of h_t, and the target's own head rows turn it into logits for
x_{t+1}. Past the last position the target has run, the draft feeds its own guesses back in
place of h: that is how it drafts several tokens, and how SSD drafts whole branches.
"""
from __future__ import annotations

import torch
from torch import nn

from saguaro.models.config import ModelConfig
from saguaro.models.kv_cache import KVCache
from saguaro.models.llama import LlamaModel, RMSNorm


class EagleDraft(LlamaModel):
    reads_features = True

    def __init__(self, config: ModelConfig):
        if not config.eagle:
            raise ValueError("EagleDraft needs a config with eagle=True")
        super().__init__(config)
        # The target's final hidden states are normed to a larger scale than token embeddings
        # (with outlier channels); this norm brings them to the embeddings' scale (its weight is
        # initialized to it), so neither half of the input drowns the other.
        self.feature_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                rows: torch.Tensor | None = None, slots: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, features: torch.Tensor | None = None) -> torch.Tensor:
        """As LlamaModel.forward, with features [B, T, hidden]: the target's hidden state (or
        the draft's guess of it) at the position before each token. Returns the draft's guess
        of the target's hidden state at each position, which is also the next input feature."""
        if features is None:
            raise ValueError("an EAGLE draft needs the target's hidden states as features")
        x = self.fc(torch.cat((self.embed_tokens(tokens), self.feature_norm(features.to(self.dtype))), dim=-1))
        return self.run_layers(x, positions, cache, rows, slots, mask)


def model_class(config: ModelConfig) -> type[LlamaModel]:
    return EagleDraft if config.eagle else LlamaModel
