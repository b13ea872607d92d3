"""An approximate radix tree of the prompts the router sent to one worker: how much of a new
prompt that worker probably has in its prefix cache.

"Approximate" because the router never sees the worker's real cache: it remembers what it sent
there (as text, or token ids for token-id prompts) and forgets the least recently used parts
past a size bound, as a worker's LRU cache would. Edges are compressed (one node per branch
point), so insert and match cost O(prompt length).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence


class _Node:
    __slots__ = ("children", "key", "last_used", "parent")

    def __init__(self, key: Sequence, parent: _Node | None):
        self.key = key  # the edge from the parent
        self.children: dict[object, _Node] = {}  # by the first element of the child's edge
        self.parent = parent
        self.last_used = 0


class PrefixTree:
    """Prompts (str or sequences of token ids) sent to one worker, at most `max_size` elements."""

    def __init__(self, max_size: int = 2_000_000):
        self.root = _Node((), None)
        self.size = 0  # elements stored (sum of edge lengths)
        self.max_size = max_size
        self._clock = itertools.count(1)

    def match(self, prompt: Sequence) -> int:
        """Length of the longest stored prefix of `prompt`."""
        node, matched = self.root, 0
        while matched < len(prompt):
            child = node.children.get(prompt[matched])
            if child is None:
                break
            common = _common(child.key, prompt, matched)
            matched += common
            if common < len(child.key):
                break
            node = child
        return matched

    def insert(self, prompt: Sequence) -> None:
        now = next(self._clock)
        node, at = self.root, 0
        node.last_used = now
        while at < len(prompt):
            child = node.children.get(prompt[at])
            if child is None:
                leaf = _Node(prompt[at:], node)
                leaf.last_used = now
                node.children[prompt[at]] = leaf
                self.size += len(leaf.key)
                break
            common = _common(child.key, prompt, at)
            if common < len(child.key):  # split the edge at the branch point
                mid = _Node(child.key[:common], node)
                child.key, child.parent = child.key[common:], mid
                mid.children[child.key[0]] = child
                node.children[prompt[at]] = mid
                child = mid
            child.last_used = now
            node, at = child, at + common
        while self.size > self.max_size:
            self._evict_one()

    def _evict_one(self) -> None:
        """Drop the least recently used leaf (a linear scan: eviction is rare)."""
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                leaves.append(node)
        if not leaves:
            self.size = 0
            return
        leaf = min(leaves, key=lambda n: n.last_used)
        del leaf.parent.children[leaf.key[0]]
        self.size -= len(leaf.key)


def _common(edge: Sequence, prompt: Sequence, at: int) -> int:
    n = min(len(edge), len(prompt) - at)
    i = 0
    while i < n and edge[i] == prompt[at + i]:
        i += 1
    return i
