#!/usr/bin/env python3
"""The file-level import graph of tpar's crates, checked against their layers.

Every `.rs` file under `crates/*/src` is a node (`tpar::backend::cuda::driver`,
`tpar_harness::cuda_bench`, `tpar_cli::bench`); an edge runs from a file to each file whose
item it names outside test code and comments, through `use` trees and paths
(`crate::`, `super::`, `self::`, a child module, another crate of the workspace). A name that a
module re-exports or imports is followed to the file that defines it, and a re-export
(`pub use driver::DeviceMemory` in a `mod.rs`) is no edge of its own: it passes a name through.

Checked, each with its count printed (exit 1 if any is not 0):
- cycles between files (strongly connected files);
- cycles between components (a crate's top-level module, or the prefix named in LAYERS);
- edges against the layers: to a higher layer of the same crate (upward), between two
  components of an isolated layer (sideways), or to a crate later in CRATES (upward);
- modules in no layer (a new top-level module must be placed in LAYERS).

Layers are by path: a file belongs to the first component whose module path prefixes its
own, so files added under a placed folder need no change here.

    python3 scripts/import_graph.py            # edges, then the checks
    python3 scripts/import_graph.py --quiet    # the checks only
    python3 scripts/import_graph.py --dot      # Graphviz of the file edges
    python3 scripts/import_graph.py --why A B  # the paths in file A that make the edge A -> B
    python3 scripts/import_graph.py --root DIR # another checkout (tests use a made-up one)
"""

from __future__ import annotations

import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# The workspace's crates, bottom first: a crate may use only the crates before it. The
# engines link `tpar` alone; the binary and the Python module sit on top.
CRATES = ["tpar", "tpar_harness", "tpar_report", "tpar_cli", "tpar_py"]

# Per crate, its layers bottom first: (layer, components, isolated). An edge may go to a
# component of a lower layer, stay inside its component, or (unless the layer is isolated) go
# to another component of the same layer. Components are module-path prefixes; "*" places
# every top-level module of the crate in that layer as a component of its own. The crate
# root (lib.rs, main.rs) is in no layer: it declares the modules, and may hold the crate's
# own error type beside them; a cycle through it is still one.
LAYERS = {
    "tpar": [
        # Vocabulary and the pure protocol: no I/O beyond the OS wrappers in sys.
        (
            "base",
            [
                "error",
                "hash",
                "cache",
                "config",
                "dtype",
                "algorithm",
                "islands",
                "memory",
                "sys",
                "wait",
                "protocol",
            ],
            False,
        ),
        # Data about the machine, known inputs, pure numerics: no backend calls.
        ("data", ["topology", "check", "norm"], False),
        # How the ranks of one job meet and are started on this host.
        ("platform", ["rendezvous", "launch"], False),
        # Policy (pure: which path runs a call) beside the transports (which run it). Neither
        # imports the other.
        ("policy|transport", ["dispatch", "backend"], True),
        # The one call path (check -> decide -> enqueue), the check a communicator runs when it
        # is made, and the process set-up every entry runs before CUDA.
        ("call path", ["communicator", "verify", "environment"], False),
    ],
    "tpar_harness": [("harness", ["*"], False)],
    "tpar_report": [("printers", ["*"], False)],
    "tpar_cli": [("command", ["*"], False)],
    "tpar_py": [("binding", ["*"], False)],
}

# ---- Reading Rust source: code without comments, strings, character literals or tests.


def code_only(text: str) -> str:
    """`text` with comments removed and string and character literals emptied."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif (m := re.compile(r'b?r(#*)"').match(text, i)) and (
            i == 0 or not text[i - 1].isalnum()
        ):
            end = text.find('"' + m.group(1), m.end())
            out.append('""')
            i = n if end < 0 else end + 1 + len(m.group(1))
        elif c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            out.append('""')
            i += 1
        elif c == "'" and (m := re.compile(r"'(\\.|\\u\{[0-9a-fA-F]+\}|[^'\\])'").match(text, i)):
            out.append("' '")
            i = m.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)


def item_end(code: str, start: int) -> int:
    """The end of the item starting at `start`: after its `;` or its matching `}`."""
    depth, i = 0, start
    while i < len(code):
        ch = code[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        elif ch == ";" and depth == 0:
            return i + 1
        i += 1
    return len(code)


CFG_TEST = re.compile(r"#\[cfg\((?:test|all\(test[^\]]*)\)\]")


def without_test_items(code: str) -> tuple[str, set[str]]:
    """`code` without its `#[cfg(test)]` items, and the names of `#[cfg(test)] mod x;` files."""
    test_files, parts, pos = set(), [], 0
    for m in CFG_TEST.finditer(code):
        if m.start() < pos:
            continue
        item = code[m.end() : item_end(code, m.end())]
        if mm := re.match(r"\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", item):
            test_files.add(mm.group(1))
        parts.append(code[pos : m.start()])
        pos = m.end() + len(item)
    parts.append(code[pos:])
    return "".join(parts), test_files


USE = re.compile(r"\b(pub(?:\([^)]*\))?\s+)?use\s+([^;]*);")
PATH = re.compile(r"(?<![\w:])(?:::)?([a-z_][a-z0-9_]*)((?:::[A-Za-z_]\w*)+)")
DEFINES = (
    r"\b(?:fn|struct|enum|union|trait|type|const|static|mod)\s+{name}\b|macro_rules!\s*{name}\b"
)


def split_use_alias(tree: str) -> str:
    """`x as y` inside a use tree, made `x@y` so that whitespace can go."""
    return re.sub(r"\b(\w+)\s+as\s+(\w+)\b", r"\1@\2", tree)


def use_entries(tree: str) -> list[tuple[list[str], str | None]]:
    """The (path, bound name) pairs of one use tree; the name is None for a glob."""
    tree = re.sub(r"\s+", "", split_use_alias(tree)).lstrip(":")
    out: list[tuple[list[str], str | None]] = []

    def walk(prefix: list[str], t: str) -> None:
        brace = t.find("{")
        if brace < 0:
            segs = prefix + [p for p in t.split("::") if p]
            if not segs:
                return
            last, _, alias = segs[-1].partition("@")
            segs[-1] = last
            if last == "*":
                out.append((segs[:-1], None))
            elif last == "self":
                out.append((segs[:-1], alias or (segs[-2] if len(segs) > 1 else None)))
            else:
                out.append((segs, alias or last))
            return
        head = [p for p in t[:brace].split("::") if p]
        inner = t[brace + 1 : t.rfind("}")]
        depth, cur = 0, ""
        for ch in inner + ",":
            if ch == "," and depth == 0:
                if cur:
                    walk(prefix + head, cur)
                cur = ""
                continue
            depth += ch == "{"
            depth -= ch == "}"
            cur += ch

    walk([], tree)
    return out


# ---- The workspace: crates, their files as modules, and what each module binds.


class Module:
    def __init__(self, crate: str, path: list[str], file: str, code: str):
        self.crate, self.path, self.file, self.code = crate, path, file, code
        self.is_dir = os.path.basename(file) in ("mod.rs", "lib.rs", "main.rs")
        # name -> (path, written in this module) for every `use`, and glob imports.
        self.uses: dict[str, list[str]] = {}
        self.globs: list[list[str]] = []
        # (start, end) of each inline `mod x { ... }`: `super` inside one is this file.
        self.inline: list[tuple[int, int]] = []
        for m in re.finditer(r"\bmod\s+\w+\s*\{", code):
            self.inline.append((m.start(), item_end(code, m.end() - 1)))
        for m in USE.finditer(code):
            if self.depth(m.start()):
                continue
            for segs, name in use_entries(m.group(2)):
                if name is None:
                    self.globs.append(segs)
                else:
                    self.uses.setdefault(name, segs)

    def depth(self, pos: int) -> int:
        """How many inline modules of this file enclose `pos`."""
        return sum(start <= pos < end for start, end in self.inline)

    @property
    def key(self) -> str:
        return "::".join([self.crate] + self.path)

    def defines(self, name: str) -> bool:
        return re.search(DEFINES.format(name=re.escape(name)), self.code) is not None


def crate_name(manifest: str) -> str | None:
    with open(manifest, encoding="utf-8") as fh:
        m = re.search(r'^\[package\][^\[]*?^name\s*=\s*"([^"]+)"', fh.read(), flags=re.M | re.S)
    return m.group(1).replace("-", "_") if m else None


def load_workspace(root: str) -> dict[str, Module]:
    modules: dict[str, Module] = {}
    crates_dir = os.path.join(root, "crates")
    for entry in sorted(os.listdir(crates_dir)):
        manifest = os.path.join(crates_dir, entry, "Cargo.toml")
        src = os.path.join(crates_dir, entry, "src")
        if not os.path.exists(manifest) or not os.path.isdir(src):
            continue
        crate = crate_name(manifest)
        roots = [f for f in ("lib.rs", "main.rs") if os.path.exists(os.path.join(src, f))]
        if not crate or not roots:
            continue
        # Walk from the root through `mod x;` declarations, so that files of test modules
        # (`#[cfg(test)] mod tests;`) and files no module declares are left out.
        pending = [(os.path.join(src, roots[0]), [])]
        while pending:
            file, path = pending.pop()
            with open(file, encoding="utf-8") as fh:
                code, test_files = without_test_items(code_only(fh.read()))
            module = Module(crate, path, file, code)
            modules[module.key] = module
            folder = os.path.dirname(file) if module.is_dir else file[:-3]
            for m in re.finditer(r"(?:pub(?:\([^)]*\))?\s+)?\bmod\s+(\w+)\s*;", code):
                child = m.group(1)
                if child in test_files:
                    continue
                for candidate in (
                    os.path.join(folder, child + ".rs"),
                    os.path.join(folder, child, "mod.rs"),
                ):
                    if os.path.exists(candidate):
                        pending.append((candidate, path + [child]))
                        break
    return modules


# ---- Resolving a path to the file that defines what it names.


class Resolver:
    def __init__(self, modules: dict[str, Module]):
        self.modules = modules
        self.crates = {m.crate for m in modules.values()}
        # `#[macro_export]` macros live at their crate's root, wherever they are written.
        self.exported_macros: dict[tuple[str, str], str] = {}
        for m in modules.values():
            for mm in re.finditer(r"#\[macro_export\]\s*macro_rules!\s*(\w+)", m.code):
                self.exported_macros[(m.crate, mm.group(1))] = m.key

    def module(self, crate: str, path: list[str]) -> Module | None:
        return self.modules.get("::".join([crate] + path))

    def resolve(
        self, current: Module, segs: list[str], seen: frozenset = frozenset(), depth: int = 0
    ) -> str | None:
        """The key of the file that defines what `segs`, written in `current`, names; None
        for what is outside the workspace (std, cudarc) or local to the file."""
        first, rest = segs[0], segs[1:]
        if first == "crate":
            return self.walk(current.crate, [], rest, seen)
        if first in ("self", "super"):
            # Inside `depth` inline modules, the first `super`s stay in this file.
            path, supers = list(current.path), [first] + rest
            rest = supers[1:]
            count = 0 if first == "self" else 1
            while rest[:1] == ["super"]:
                count, rest = count + 1, rest[1:]
            count = max(0, count - depth)
            return self.walk(current.crate, path[: len(path) - count], rest, seen)
        if first in self.crates:
            return self.walk(first, [], rest, seen)
        if self.module(current.crate, current.path + [first]):
            return self.walk(current.crate, current.path + [first], rest, seen)
        if first in current.uses and (current.key, first) not in seen:
            return self.resolve(current, current.uses[first] + rest, seen | {(current.key, first)})
        return None

    def walk(self, crate: str, path: list[str], rest: list[str], seen: frozenset) -> str | None:
        module = self.module(crate, path)
        if module is None:
            return None
        for name in rest:
            child = self.module(crate, module.path + [name])
            if child is not None:
                module = child
                continue
            if module.defines(name):
                return module.key
            if name in module.uses and (module.key, name) not in seen:
                target = module.uses[name]
                found = self.resolve(module, target, seen | {(module.key, name)})
                return found or module.key
            for glob in module.globs:
                if (module.key, "*", tuple(glob)) in seen:
                    continue
                found = self.resolve(module, glob + [name], seen | {(module.key, "*", tuple(glob))})
                if found:
                    return found
            macro = self.exported_macros.get((crate, name))
            if macro and not module.path:
                return macro
            return module.key
        return module.key


def edges_of(modules: dict[str, Module], why: dict | None = None) -> set[tuple[str, str]]:
    """The file edges; `why`, when given, gets the paths behind each edge."""
    resolver = Resolver(modules)
    edges = set()
    for module in modules.values():
        code = module.code
        # A re-export (`pub use`, `pub(crate) use`) passes a name through: its users get an
        # edge to the file that defines it, the re-exporting file none of its own.
        paths = [
            (segs, module.depth(m.start()))
            for m in USE.finditer(code)
            if not m.group(1)
            for segs, _ in use_entries(m.group(2))
            if segs
        ]
        # Blank out the use statements (keeping offsets, for the inline-module depth).
        rest = USE.sub(lambda m: " " * len(m.group(0)), code)
        for m in PATH.finditer(rest):
            paths.append(([m.group(1)] + m.group(2).split("::")[1:], module.depth(m.start())))
        for segs, depth in paths:
            target = resolver.resolve(module, segs, depth=depth)
            if target and target != module.key:
                edges.add((module.key, target))
                if why is not None:
                    why.setdefault((module.key, target), set()).add("::".join(segs))
    return edges


# ---- The checks.


def place(module: Module) -> tuple[int, str, str] | None:
    """(layer index, layer name, component) of a module; the crate root is above all."""
    layers = LAYERS.get(module.crate)
    if layers is None:
        return None
    if not module.path:
        return -1, "root", module.crate
    dotted = "::".join(module.path)
    for rank, (name, comps, _) in enumerate(layers):
        for comp in comps:
            if comp == "*":
                return rank, name, f"{module.crate}::{module.path[0]}"
            if dotted == comp or dotted.startswith(comp + "::"):
                return rank, name, f"{module.crate}::{comp}"
    return None


def strongly_connected(nodes: set[str], edges: set[tuple[str, str]]) -> list[list[str]]:
    graph: dict[str, list[str]] = {n: [] for n in nodes}
    for a, b in edges:
        graph[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        # Iterative Tarjan: (node, next successor to look at).
        work = [(root, 0)]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, i = work[-1]
            succ = sorted(graph[v])
            if i < len(succ):
                work[-1] = (v, i + 1)
                w = succ[i]
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, 0))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                scc = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    scc.append(w)
                    if w == v:
                        break
                if len(scc) > 1:
                    found.append(sorted(scc))
    return found


def main() -> int:
    quiet = "--quiet" in sys.argv
    root = sys.argv[sys.argv.index("--root") + 1] if "--root" in sys.argv else ROOT
    modules = load_workspace(root)
    why: dict[tuple[str, str], set[str]] = {}
    edges = edges_of(modules, why)
    if "--why" in sys.argv:
        a, b = sys.argv[sys.argv.index("--why") + 1 : sys.argv.index("--why") + 3]
        for path in sorted(why.get((a, b), ())):
            print(path)
        return 0 if (a, b) in edges else 1

    unplaced = {m.key for m in modules.values() if m.crate not in CRATES or place(m) is None}
    violations, comp_edges = [], set()
    for a, b in sorted(edges):
        ma, mb = modules[a], modules[b]
        if ma.crate not in CRATES or mb.crate not in CRATES:
            continue
        if ma.crate != mb.crate:
            if CRATES.index(mb.crate) > CRATES.index(ma.crate):
                violations.append(f"{a} -> {b}  (upward: crate {ma.crate} -> crate {mb.crate})")
            continue
        pa, pb = place(ma), place(mb)
        if pa is None or pb is None or pa[2] == pb[2]:
            continue
        comp_edges.add((pa[2], pb[2]))
        layers = LAYERS[ma.crate]
        if pa[0] < 0 or pb[0] < 0:
            continue  # the crate root is outside the layers (its cycles are still found)
        if pb[0] > pa[0] or (pb[0] == pa[0] and layers[pa[0]][2]):
            kind = "upward" if pb[0] > pa[0] else "sideways"
            violations.append(f"{a} -> {b}  ({kind}: {pa[1]}/{pa[2]} -> {pb[1]}/{pb[2]})")

    file_cycles = strongly_connected(set(modules), edges)
    comps = {c for e in comp_edges for c in e}
    comp_cycles = strongly_connected(comps, comp_edges)

    if "--dot" in sys.argv:
        print("digraph tpar {")
        for a, b in sorted(edges):
            print(f'  "{a}" -> "{b}";')
        print("}")
        return 0
    if not quiet:
        print(f"# {len(edges)} file edges between {len(modules)} files")
        for a, b in sorted(edges):
            print(f"{a} -> {b}")
        print()
        print("# crates, bottom first: " + " < ".join(CRATES))
        for crate, layers in LAYERS.items():
            for name, comps_, isolated in layers:
                note = " (isolated: no edges between these)" if isolated else ""
                print(f"{crate} {name}: {', '.join(comps_)}{note}")
        print()
    print(f"# file-level cycles: {len(file_cycles)}")
    for scc in file_cycles:
        print("cycle: " + " <-> ".join(scc))
    print(f"# cycles between components: {len(comp_cycles)}")
    for scc in comp_cycles:
        print("cycle: " + " <-> ".join(scc))
    print(f"# edges against the layers: {len(violations)}")
    for v in violations:
        print(v)
    print(f"# modules in no layer: {len(unplaced)}")
    for m in sorted(unplaced):
        print(
            f"{m} (add its crate to CRATES, its top-level module to LAYERS in scripts/import_graph.py)"
        )
    return 1 if file_cycles or comp_cycles or violations or unplaced else 0


if __name__ == "__main__":
    sys.exit(main())
