"""What :class:`harness.model.draws.Draws` counts as drawing random numbers in a forward: only ops that
draw, in the module that runs them (tests/test_users_random.py runs whole cells)."""
import torch
import torch.nn.functional as F
from torch import nn

from harness.model.draws import Draws, not_judged


class Block(nn.Module):
    def __init__(self, p: float, noise: float = 0.0):
        super().__init__()
        self.proj, self.drop, self.noise = nn.Linear(8, 8), nn.Dropout(p), noise

    def forward(self, x):
        q = self.proj(x).reshape(2, 2, 4, 2)
        x = x + F.scaled_dot_product_attention(q, q, q, dropout_p=0.0).reshape(4, 8)  # tagged seeded, draws nothing
        if self.training and self.noise:
            x = x * torch.empty_like(x).uniform_(1 - self.noise, 1 + self.noise)  # router jitter
        return self.drop(x)


def drawn(model: nn.Module) -> dict:
    """The ops that draw, each with its modules; and the cheap check agrees whether any did."""
    x = torch.randn(4, 8, dtype=torch.float64)
    model = model.double()
    with Draws(model) as cheap:
        model(x).sum().backward()
    with Draws(model, watch=True) as watched:
        model(x).sum().backward()
    assert cheap.drew == watched.drew == bool(watched.found)
    return watched.found


def test_dropout_of_zero_and_attention_without_dropout_draw_nothing():
    assert drawn(nn.Sequential(Block(0.0), Block(0.0))) == {}


def test_each_draw_is_named_with_the_innermost_module_running_it():
    found = drawn(nn.Sequential(Block(0.0, noise=0.1), Block(0.3)))
    assert found == {"aten.uniform_(from=0.9, to=1.1)": ["0"], "aten.bernoulli_(p=0.7)": ["1.drop"]}


def test_a_model_in_eval_mode_draws_nothing():
    assert drawn(nn.Sequential(Block(0.3, noise=0.1)).eval()) == {}


def test_the_line_names_ops_modules_and_the_fix():
    model = nn.Sequential(Block(0.3), Block(0.3), Block(0.3), Block(0.3))
    line = not_judged(model, drawn(model))
    assert line == ("the model draws random numbers in training mode (aten.bernoulli_(p=0.7) in 0.drop, 1.drop, "
                    "2.drop and 1 more), which a parallel run cannot draw as one process does, so no cell of it is "
                    "judged; turn them off in build: give 0.drop, 1.drop, 2.drop and the rest p=0 (0.drop is "
                    "Dropout(p=0.3, inplace=False)), or call .eval() on them")
    jitter = nn.Sequential(Block(0.0, noise=0.1))
    assert not_judged(jitter, drawn(jitter)).endswith("turn them off in build: call .eval() on 0 (or set what makes "
                                                      "them draw to 0)")
