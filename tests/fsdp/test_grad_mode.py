"""fsdp.group.grad_mode.without_grad: torch.no_grad's contract on the per-unit hot path."""

import pytest
import torch

from fsdp.group.grad_mode import without_grad


@without_grad
def _mode_and_product(x: torch.Tensor) -> tuple[bool, torch.Tensor]:
    return torch.is_grad_enabled(), x * 2


@without_grad
def _raise() -> None:
    assert not torch.is_grad_enabled()
    raise KeyError("inside")


@pytest.mark.parametrize("outer", [True, False])
def test_grad_is_off_inside_and_the_callers_mode_comes_back(outer: bool) -> None:
    x = torch.ones(3, requires_grad=True)
    with torch.set_grad_enabled(outer):
        inside, y = _mode_and_product(x)
        assert torch.is_grad_enabled() is outer
    assert inside is False
    assert not y.requires_grad and y.grad_fn is None


def test_grad_mode_comes_back_after_a_raise() -> None:
    with torch.enable_grad():
        with pytest.raises(KeyError, match="inside"):
            _raise()
        assert torch.is_grad_enabled()


def test_the_wrapper_keeps_the_name_and_docstring() -> None:
    @without_grad
    def documented() -> None:
        """Says why."""

    assert documented.__name__ == "documented" and documented.__doc__ == "Says why."
