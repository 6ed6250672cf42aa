"""Token trees: TokenTree (parents -> mask, depths, paths), tree specs and builders."""

from specdec.trees.spec import TreeSpec
from specdec.trees.tree import ROOT, TokenTree, tree_attention_bias

__all__ = ["ROOT", "TokenTree", "TreeSpec", "tree_attention_bias"]
