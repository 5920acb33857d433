"""The attention tests' cases are tables of keyword options: :func:`attend` calls
``yamlformer.kernels.attention`` with them, the mask's options gathered into one
:class:`~yamlformer.kernels.masks.Mask` as every caller passes them."""

from __future__ import annotations

from yamlformer.kernels import Mask, attention


def attend(q, k, v, *, scale=None, backend="auto", dropout_p=0.0, **mask):
    """``attention(q, k, v, Mask(**mask), scale=..., backend=..., dropout_p=...)``."""
    return attention(q, k, v, Mask(**mask), scale=scale, backend=backend, dropout_p=dropout_p)
