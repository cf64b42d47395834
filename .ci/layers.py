#!/usr/bin/env python3
"""The architecture, checked: the workspace's crates in CRATES order, the runtime's modules in
LAYERS order, and no import cycle between the files or top-level modules of any library.

Crates: a member may depend (in its Cargo.toml, by path) only on members of earlier groups.
Files: A depends on B when A names (in a `use` or a path) an item *defined* in B; re-exports are
followed to the defining file, `mod x;` declarations are ownership, not use, and `#[cfg(test)]`
modules are left out (test code may reach anywhere). The graphs of the runtime (src/) and of the
training engine (crates/train/src) must be acyclic, between files and between top-level modules,
and the runtime's top-level modules must respect LAYERS.

    python3 .ci/layers.py            # check: prints cycles and layer violations, exit 1 if any
    python3 .ci/layers.py --edges    # "A B" lines (A depends on B): pipe into `tsort`, which
                                     # reports any loop ("tsort: -: input contains a loop")
    python3 .ci/layers.py --modules  # the top-level module graph
    python3 .ci/layers.py --crate train --modules   # the same for the training engine
"""
import os
import re
import sys

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# The libraries whose files are checked, by the name --crate takes.
LIBRARIES = {"runtime": "src", "train": "crates/train/src"}
ROOT = os.path.join(REPO, LIBRARIES["runtime"])

# The workspace, bottom to top: a member may depend only on members of earlier groups.
CRATES = [
    ["lockstep-comm"],  # the runtime (.)
    ["lockstep-train", "lockstep-cli", "lockstep-capi"],  # crates/train, crates/cli, crates/capi
    ["lockstep-python"],  # python/ (the extension runs the CLI's library too)
]

# The runtime's modules, bottom to top: a module may import only from modules in earlier groups (or its own).
LAYERS = [
    ["types", "store"],
    ["cuda", "logging", "trace"],  # trace: the flight recorder, below comm which records
    ["comm", "config", "reference"],
    ["shm", "nccl", "staged", "mpi"],
    ["hier"],  # shared memory in each node + MPI between nodes, over shm and mpi
    ["rendezvous", "report", "status"],
    ["launch"],
    ["crate"],  # lib.rs: declarations and re-exports only
]


def module_files():
    files = {}
    for dirpath, _, names in os.walk(ROOT):
        for n in names:
            if not n.endswith(".rs"):
                continue
            path = os.path.relpath(os.path.join(dirpath, n), ROOT)
            if path.startswith("bin" + os.sep):
                continue
            parts = path[:-3].split(os.sep)
            if parts[-1] in ("mod", "lib"):
                parts = parts[:-1]
            files[tuple(["crate"] + parts)] = path
    return files


COMMENT = re.compile(r"//.*?$|/\*.*?\*/", re.S | re.M)
STRING = re.compile(r'b?r#*"(?:.|\n)*?"#*|b?"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])\'')


def strip(src):
    src = COMMENT.sub("", src)
    src = STRING.sub('""', src)
    # Drop #[cfg(test)] items: a `mod name { ... }` block with balanced braces.
    out, i = [], 0
    for m in re.finditer(r"#\[cfg\(test\)\]\s*(#\[[^\]]*\]\s*)*(pub(\([^)]*\))?\s+)?mod\s+\w+\s*\{", src):
        if m.start() < i:
            continue
        out.append(src[i : m.start()])
        depth, j = 1, m.end()
        while j < len(src) and depth:
            depth += {"{": 1, "}": -1}.get(src[j], 0)
            j += 1
        i = j
    out.append(src[i:])
    return "".join(out)


def expand_use(tree):
    """`a::{b, c::{d, e as f}, self}` -> ['a::b', 'a::c::d', 'a::c::e', 'a']"""
    tree = re.sub(r"\s+as\s+\w+", "", tree)
    tree = re.sub(r"\s+", "", tree)

    def rec(prefix, t):
        res = []
        i = t.find("{")
        if i < 0:
            for part in t.split(","):
                if not part:
                    continue
                p = prefix + part
                res.append(p[:-6] if p.endswith("::self") else p)
            return res
        # split top-level by commas
        depth, cur, items = 0, "", []
        for ch in t:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            if ch == "," and depth == 0:
                items.append(cur)
                cur = ""
            else:
                cur += ch
        items.append(cur)
        for it in items:
            if not it:
                continue
            k = it.find("{")
            if k < 0:
                res += rec(prefix, it)
            else:
                head = it[:k]
                body = it[k + 1 : it.rfind("}")]
                res += rec(prefix + head, body)
        return res

    return rec("", tree)


def parse(files):
    info = {}
    for mod, path in files.items():
        src = strip(open(os.path.join(ROOT, path)).read())
        uses, reexports = [], {}
        for m in re.finditer(r"(pub(\([^)]*\))?\s+)?use\s+([^;]+);", src):
            for p in expand_use(m.group(3)):
                uses.append(p)
                if m.group(1):
                    reexports[p.split("::")[-1]] = p
        children = set(re.findall(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", src, re.M))
        body = re.sub(r"(pub(\([^)]*\))?\s+)?use\s+[^;]+;", "", src)
        paths = re.findall(r"\b((?:crate|super|self|[a-z_][a-z0-9_]*)(?:::[A-Za-z_][A-Za-z0-9_]*)+)", body)
        defined = set(re.findall(r"\b(?:fn|struct|enum|trait|type|const|static|union|macro_rules!)\s+([A-Za-z_]\w*)", src))
        info[mod] = dict(path=path, uses=uses + paths, reexports=reexports, children=children, defined=defined)
    return info


def absolute(mod, p, info):
    segs = p.split("::")
    if segs[0] == "crate":
        return segs
    if segs[0] == "self":
        return list(mod) + segs[1:]
    if segs[0] == "super":
        base = list(mod)
        while segs and segs[0] == "super":
            base = base[:-1]
            segs = segs[1:]
        return base + segs
    if segs[0] in info[mod]["children"]:
        return list(mod) + segs
    return None  # an external crate or a local name


def resolve(segs, info, depth=0):
    """The module that defines the item `segs` names (following re-exports)."""
    best = None
    for k in range(len(segs), 0, -1):
        if tuple(segs[:k]) in info:
            best = k
            break
    if best is None:
        return None
    mod = tuple(segs[:best])
    rest = segs[best:]
    if not rest or depth > 8:
        return mod
    name = rest[0]
    if name in info[mod]["defined"]:
        return mod
    target = info[mod]["reexports"].get(name)
    if target:
        t = absolute(mod, target, info)
        if t:
            r = resolve(t + rest[1:], info, depth + 1)
            if r:
                return r
    return mod


def graph():
    files = module_files()
    info = parse(files)
    edges = {m: set() for m in info}
    for mod in info:
        for p in info[mod]["uses"]:
            segs = absolute(mod, p, info)
            if not segs:
                continue
            t = resolve(segs, info)
            if t and t != mod:
                edges[mod].add(t)
    return info, edges


def sccs(edges):
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def top(m):
    return m[1] if len(m) > 1 else "crate"


def crate_problems():
    """Members that depend on a member of their own or a later CRATES group."""
    members = {}
    for d in [".", "crates/train", "crates/cli", "crates/capi", "python"]:
        toml = open(os.path.join(REPO, d, "Cargo.toml")).read()
        name = re.search(r'(?m)^name\s*=\s*"([^"]+)"', toml).group(1)
        deps = re.search(r"(?ms)^\[dependencies\]\n(.*?)(?=^\[)", toml + "\n[")
        paths = re.findall(r'path\s*=\s*"([^"]+)"', deps.group(1) if deps else "")
        members[name] = (d, [os.path.normpath(os.path.join(d, p)) for p in paths])
    by_dir = {os.path.normpath(d): n for n, (d, _) in members.items()}
    level = {m: i for i, group in enumerate(CRATES) for m in group}
    out = []
    for name, (_, paths) in sorted(members.items()):
        if name not in level:
            out.append(f"crate {name} is not in CRATES (.ci/layers.py): place it")
            continue
        for p in paths:
            dep = by_dir.get(p)
            if dep is None:
                continue
            if dep not in level:
                out.append(f"crate {dep} is not in CRATES (.ci/layers.py): place it")
            elif level[dep] >= level[name]:
                out.append(f"crate order: {name} depends on {dep}, which is not below it in CRATES")
    return out


def main():
    global ROOT
    lib = "runtime"
    if "--crate" in sys.argv:
        lib = sys.argv[sys.argv.index("--crate") + 1]
        if lib not in LIBRARIES:
            print(f"--crate {lib}: one of {', '.join(LIBRARIES)}")
            return 2
    if "--edges" in sys.argv or "--modules" in sys.argv:
        ROOT = os.path.join(REPO, LIBRARIES[lib])
        return check(lib)
    bad = 0
    for p in crate_problems():
        bad += 1
        print(p)
    for lib in LIBRARIES:
        ROOT = os.path.join(REPO, LIBRARIES[lib])
        bad += check(lib)
    return 1 if bad else 0


def check(lib):
    info, edges = graph()
    name = lambda m: info[m]["path"]
    if "--edges" in sys.argv:
        for a in sorted(edges):
            for b in sorted(edges[a]):
                print(name(a), name(b))
        return 0
    tops = {}
    for a, bs in edges.items():
        for b in bs:
            if top(a) != top(b):
                tops.setdefault(top(a), set()).add(top(b))
    if "--modules" in sys.argv:
        for a in sorted(tops):
            print(f"{a} -> {', '.join(sorted(tops[a]))}")
        return 0
    bad = 0
    for comp in sccs(edges):
        bad += 1
        print("file cycle: " + " <-> ".join(name(m) for m in comp))
        for a in comp:
            for b in sorted(edges[a]):
                if b in comp:
                    print(f"    {name(a)} uses {name(b)}")
    for comp in sccs({a: set(bs) for a, bs in tops.items()}):
        bad += 1
        print("module cycle: " + " <-> ".join(comp))
    level = {m: i for i, group in enumerate(LAYERS) for m in group}
    for a in sorted(tops) if lib == "runtime" else []:
        for b in sorted(tops[a]):
            if a not in level or b not in level:
                bad += 1
                print(f"module {a if a not in level else b} is not in LAYERS (.ci/layers.py): place it")
            elif level[b] >= level[a] and a != "crate":
                bad += 1
                offenders = sorted(f"{name(x)} -> {name(y)}" for x in edges for y in edges[x] if top(x) == a and top(y) == b)
                print(f"layer violation: {a} imports {b} ({'; '.join(offenders)})")
    files = len(info)
    nedges = sum(len(v) for v in edges.values())
    print(f"{LIBRARIES[lib]}: {files} files, {nedges} file dependencies, {bad} problem(s)")
    return bad


if __name__ == "__main__":
    sys.exit(main())
