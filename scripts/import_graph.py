#!/usr/bin/env python3
"""The module import graph of crates/tpar/src, checked against tpar's layers.

Prints every edge (module -> module it uses, outside test code and comments), then any
cycle between top-level components, then any edge that runs from a lower layer to a higher
one or sideways between two components of the same layer. Exits 1 when there is a cycle or a
forbidden edge, so CI or the coordinator can rerun it after each merge:

    python3 scripts/import_graph.py            # edges, cycles, violations
    python3 scripts/import_graph.py --quiet    # cycles and violations only
    python3 scripts/import_graph.py --dot      # Graphviz of the components

A module is named by its path (`backend::cuda::link_measurement`); an edge is recorded to the
deepest module a path names (`crate::backend::cuda::driver::bind` -> `backend::cuda::driver`).
Layers are judged per component: the layer list below maps each module to the first
component whose prefix matches it.
"""

import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "tpar", "src")

# Bottom first: (layer, components, isolated). An edge may go to a component of a LOWER
# layer, stay inside its own component, or (unless the layer is isolated) go to another
# component of the same layer; an edge to a higher layer, or between two components of an
# isolated layer, is a violation. Components are module-path prefixes.
LAYERS = [
    # Vocabulary and the pure protocol: no I/O beyond the OS wrappers in sys.
    ("base", ["error", "hash", "cache", "config", "dtype", "algorithm", "memory", "sys", "wait", "protocol"], False),
    # Data about the machine, known inputs, pure numerics: no backend calls.
    ("data", ["topology", "check", "norm"], False),
    # How the ranks of one job meet and are started on this host.
    ("platform", ["rendezvous", "launch"], False),
    # Policy (pure: which path runs a call) beside the transports (which run it). Neither
    # imports the other.
    ("policy|transport", ["dispatch", "backend"], True),
    # The one call path: check -> decide -> enqueue over the backends.
    ("call path", ["communicator", "verify"], False),
    # What is built on a communicator: capacity planning, the harness.
    ("tools", ["planner", "harness"], False),
]

# The one facade at the top: re-exports every layer's names.
FACADE = "lib"


def module_of(path):
    rel = os.path.relpath(path, ROOT)[:-3]  # strip .rs
    parts = rel.split(os.sep)
    if parts[-1] == "mod":
        parts = parts[:-1]
    if parts == ["lib"]:
        return "lib"
    return "::".join(parts)


def strip_tests_and_comments(text):
    # Test modules sit at the end of a file (`#[cfg(test)] mod tests {`) or in tests.rs.
    m = re.search(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", text)
    if m:
        text = text[: m.start()]
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    return text


def expand_use_tree(prefix, tree):
    """`a::{b, c::{d, e}}` -> [a::b, a::c::d, a::c::e]."""
    tree = tree.strip()
    brace = tree.find("{")
    if brace < 0:
        return [prefix + tree]
    head = tree[:brace]
    inner = tree[brace + 1 : tree.rfind("}")]
    items, depth, cur = [], 0, ""
    for ch in inner:
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    items.append(cur)
    out = []
    for item in items:
        if item.strip():
            out.extend(expand_use_tree(prefix + head, item))
    return out


def referenced_paths(text):
    paths = []
    for m in re.finditer(r"\buse\s+((?:crate|super|self)::[^;]*);", text, flags=re.S):
        paths.extend(expand_use_tree("", re.sub(r"\s+", "", m.group(1))))
    text = re.sub(r"\buse\s+[^;]*;", "", text, flags=re.S)
    paths.extend(re.findall(r"\b(?:crate|super)(?:::\w+)+", text))
    return paths


def resolve(path, current, modules, is_dir_module):
    parts = path.split("::")
    if parts[0] == "crate":
        base = []
    else:
        base = current.split("::") if current != "lib" else []
        if not is_dir_module:
            base = base[:-1]  # a file module's `super` is its parent
        while parts and parts[0] in ("super", "self"):
            if parts[0] == "super":
                base = base[:-1]
            parts = parts[1:]
        parts = ["crate"] + parts
    names = base + parts[1:]
    for n in range(len(names), 0, -1):
        cand = "::".join(names[:n])
        if cand in modules:
            return cand
    return None


def component(module):
    for rank, (_, comps, _) in enumerate(LAYERS):
        for c in comps:
            if module == c or module.startswith(c + "::"):
                return rank, c
    return None, module


def main():
    quiet = "--quiet" in sys.argv
    dot = "--dot" in sys.argv
    files = []
    for dirpath, _, names in os.walk(ROOT):
        for n in names:
            if n.endswith(".rs") and n != "tests.rs":
                files.append(os.path.join(dirpath, n))
    modules = {module_of(f) for f in files}
    edges = set()
    for f in sorted(files):
        mod = module_of(f)
        is_dir_module = os.path.basename(f) in ("mod.rs", "lib.rs")
        with open(f, encoding="utf-8") as fh:
            text = strip_tests_and_comments(fh.read())
        for p in referenced_paths(text):
            target = resolve(p, mod, modules, is_dir_module)
            if target and target != mod:
                edges.add((mod, target))

    comp_edges = set()
    violations = []
    unplaced = set()
    for a, b in sorted(edges):
        if a == FACADE:
            continue
        ra, ca = component(a)
        rb, cb = component(b)
        for r, c in ((ra, ca), (rb, cb)):
            if r is None:
                unplaced.add(c)
        if ca == cb:
            continue
        comp_edges.add((ca, cb))
        if ra is not None and rb is not None and (rb > ra or (rb == ra and LAYERS[ra][2])):
            kind = "upward" if rb > ra else "sideways"
            violations.append(
                f"{a} -> {b}  ({kind}: {LAYERS[ra][0]}/{ca} -> {LAYERS[rb][0]}/{cb})"
            )

    # Cycles between components (Tarjan's strongly connected components).
    graph = {}
    for a, b in comp_edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, stack, on, sccs = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                sccs.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            strong(v)

    if dot:
        print("digraph tpar {")
        for a, b in sorted(comp_edges):
            print(f'  "{a}" -> "{b}";')
        print("}")
        return 0
    if not quiet:
        print(f"# {len(edges)} module edges ({len(modules)} modules)")
        for a, b in sorted(edges):
            print(f"{a} -> {b}")
        print()
        print("# layers, bottom first")
        for name, comps, isolated in LAYERS:
            note = " (isolated: no edges between these)" if isolated else ""
            print(f"{name}: {', '.join(comps)}{note}")
        print()
    print(f"# cycles between components: {len(sccs)}")
    for scc in sccs:
        print("cycle: " + " <-> ".join(scc))
    print(f"# edges against the layers: {len(violations)}")
    for v in violations:
        print(v)
    if unplaced:
        print("# modules in no layer (add them to LAYERS): " + ", ".join(sorted(unplaced)))
    return 1 if sccs or violations or unplaced else 0


if __name__ == "__main__":
    sys.exit(main())
