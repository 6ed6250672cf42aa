"""Token trees: TokenTree (parents -> mask, depths, paths) and tree builders."""

from specdec.trees.tree import ROOT, TokenTree, tree_attention_bias

__all__ = ["ROOT", "TokenTree", "tree_attention_bias"]
