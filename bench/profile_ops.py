"""Where a decode step's GPU time goes, by kind of op, against its roofline (``bench_engine.py --profile-batch``).

- ``hlo_kernels``: every kernel-launching instruction of a compiled program's optimised HLO (fusions,
  library calls, Pallas kernels, in-place updates, copies), classified by what it computes
  (``CATEGORIES``), GEMMs labelled by their shape against the model's (QKV, O, gate-up, down, LM
  head...) with their FLOPs;
- ``attribute``: a profiler trace's GPU kernels matched to those instructions (through the profiler's
  ``hlo_op`` annotation where it has one, else the kernel's name, which XLA derives from the fusion's;
  library and Pallas kernels without either by their names), summed per category and label;
- ``roofline``: the step's FLOPs and bytes per op from the model's shapes (a step of ``batch`` rows and
  ``block`` tokens each at ``context``), and the time each needs at the device's peak rates.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

# NVIDIA's H200 SXM datasheet: dense bf16 tensor-core peak (989 TFLOP/s; 1,979 is with sparsity).
H200_BF16_FLOPS = 989e12

CATEGORIES = ("GEMM", "attention", "argmax / top-k", "reductions (norms, softmax)", "cache and state writes",
              "copies and slices", "elementwise", "collectives", "other")
_COLLECTIVES = {"all-reduce", "all-reduce-start", "all-gather", "all-gather-start", "reduce-scatter", "all-to-all",
                "collective-permute", "collective-permute-start"}

_DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f64": 8, "s64": 8}
_MOVES = {"copy", "transpose", "bitcast", "parameter", "reshape", "broadcast", "slice", "concatenate", "convert",
          "dynamic-slice", "constant", "tuple", "get-tuple-element", "iota", "pad", "reverse"}


@dataclasses.dataclass
class HloKernel:
    """One kernel-launching HLO instruction."""

    name: str
    category: str
    label: str           # what it is: a GEMM's role and shape, a custom call's target, a fusion's ops
    flops: float = 0.0   # per launch (GEMMs)


def normalize(name: str) -> str:
    """A kernel or instruction name as XLA names its kernels (``.`` and ``-`` become ``_``)."""
    return re.sub(r"[^0-9A-Za-z]", "_", name)


def _dims(shape: str) -> list[int]:
    m = re.match(r"\s*\(?\s*[a-z0-9]+\[([0-9,]*)\]", shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _split_instruction(line: str):
    """``%name = SHAPE opcode(operands), attrs`` -> (name, shape, opcode, operand names, attrs) or None."""
    m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*", line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):  # a tuple shape: up to its matching parenthesis
        depth = 0
        for i, ch in enumerate(rest):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                break
        shape, rest = rest[:i + 1], rest[i + 1:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
        return None
    depth, i = 0, op.end() - 1
    for i in range(op.end() - 1, len(rest)):
        depth += (rest[i] == "(") - (rest[i] == ")")
        if depth == 0:
            break
    operands = re.findall(r"%([\w.\-]+)", rest[op.end():i])
    return m.group(1), shape, op.group(1), operands, rest[i + 1:]


# A computation's first line in an HLO module's text: ``[ENTRY] %name (params) -> shape {``.
_COMPUTATION_HEAD = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def parse_computations(hlo: str) -> dict[str, dict[str, tuple]]:
    """``{computation: {instruction: (shape, opcode, operands, attrs)}}`` of an HLO module's text."""
    comps, current = {}, None
    for line in hlo.splitlines():
        head = _COMPUTATION_HEAD.match(line)
        if head and not line.startswith(" "):
            current = comps.setdefault(head.group(1), {})
            continue
        if line.startswith("}"):
            current = None
            continue
        if current is not None and (parts := _split_instruction(line)) is not None:
            current[parts[0]] = parts[1:]
    return comps


def _gemm(instrs: dict, name: str, roles: dict) -> tuple[str, float]:
    """A dot's (or a library GEMM's) label and FLOPs from its output and left operand's shapes."""
    shape, _, operands, attrs = instrs[name]
    out = _dims(shape)
    lhs = _dims(instrs[operands[0]][0]) if operands and operands[0] in instrs else []
    # A dot's attribute, or a library GEMM's backend config (``"lhs_contracting_dimensions":["1"]``).
    contracting = (re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", attrs)
                   or re.search(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]', attrs))
    dims = [int(d) for d in re.findall(r"\d+", contracting.group(1))] if contracting else []
    k = math.prod(lhs[d] for d in dims if d < len(lhs)) if dims and lhs else 0
    if not out or not k:
        return "GEMM", 0.0
    n, m = out[-1], math.prod(out[:-1])
    role = roles.get((n, k)) or roles.get(n) or ""
    return f"{role + ' ' if role else ''}[{m} x {k}] @ [{k} x {n}]".strip(), 2.0 * m * n * k


def _classify_fusion(comps: dict, comp: str, roles: dict) -> tuple[str, str, float]:
    instrs = comps.get(comp, {})
    ops = {v[1] for v in instrs.values()}
    dots = [n for n, v in instrs.items() if v[1] == "dot"]
    if dots:
        label, flops = _gemm(instrs, dots[0], roles)
        return "GEMM", label, flops
    if "custom-call" in ops:
        return "other", "custom call in a fusion", 0.0
    if "sort" in ops:
        return "argmax / top-k", "sort", 0.0
    reduces = [v for v in instrs.values() if v[1] == "reduce"]
    if any(v[0].startswith("(") for v in reduces):  # a variadic (value, index) reduce
        return "argmax / top-k", "argmax", 0.0
    if reduces:
        return "reductions (norms, softmax)", "reduce " + _shapes(reduces), 0.0
    if ops & {"dynamic-update-slice", "scatter"}:
        return "cache and state writes", ", ".join(sorted(ops & {"dynamic-update-slice", "scatter"})), 0.0
    if ops <= _MOVES:
        return "copies and slices", ", ".join(sorted(ops - {"parameter", "bitcast", "tuple", "get-tuple-element"})), 0.0
    return "elementwise", ", ".join(sorted(ops - _MOVES))[:80], 0.0


def _shapes(instrs) -> str:
    return ", ".join(sorted({v[0].split("{")[0] for v in instrs}))[:60]


def model_roles(tc, dc=None) -> dict:
    """GEMM roles by (output width, contraction) of a target config ``tc`` (and drafter config ``dc``)."""
    h, hd = tc.hidden_size, tc.head_dim
    roles = {((tc.num_heads + 2 * tc.num_kv_heads) * hd, h): "QKV", (h, tc.num_heads * hd): "O proj",
             (2 * tc.intermediate_size, h): "gate-up", (h, tc.intermediate_size): "down",
             (tc.vocab_size, h): "LM head", tc.vocab_size: "LM head"}
    if dc is not None:
        roles[(h, len(dc.target_layer_ids) * h)] = "drafter fc (taps)"
        roles[(dc.num_kv_heads * dc.num_layers * 2 * dc.head_dim, h)] = "drafter context K/V"
    return roles


def hlo_kernels(hlo: str, roles: dict) -> dict[str, HloKernel]:
    """Every kernel-launching instruction of an optimised HLO module, by ``normalize``d name."""
    comps = parse_computations(hlo)
    fused = {m.group(1) for v in (i for c in comps.values() for i in c.values())
             for m in [re.search(r"calls=%?([\w.\-]+)", v[3])] if m and v[1] == "fusion"}
    kernels = {}
    for comp, instrs in comps.items():
        if comp in fused:
            continue  # inside a fusion: its kernel is the fusion's
        for name, (shape, op, operands, attrs) in instrs.items():
            if op == "fusion":
                called = re.search(r"calls=%?([\w.\-]+)", attrs)
                category, label, flops = _classify_fusion(comps, called.group(1) if called else "", roles)
            elif op == "custom-call":
                target = re.search(r'custom_call_target="([^"]+)"', attrs)
                target = target.group(1) if target else "?"
                if "gemm" in target or "matmul" in target:
                    label, flops = _gemm(instrs, name, roles)
                    category = "GEMM"
                else:
                    kernel = re.search(r'\\?"name\\?"\s*:\s*\\?"([^"\\]+)', attrs)
                    label = kernel.group(1) if kernel else target
                    category = "attention" if "attention" in label else "other"
                    flops = 0.0
                    if kernel:  # a Pallas kernel is launched under its own name
                        kernels.setdefault(normalize(label), HloKernel(label, category, label))
            elif op in _COLLECTIVES:  # a mesh's exchanges (NCCL kernels)
                category, label, flops = "collectives", f"{op.removesuffix('-start')} {shape.split('{')[0]}", 0.0
            elif op in ("copy", "transpose"):
                category, label, flops = "copies and slices", f"{op} {shape.split('{')[0]}", 0.0
            elif op in ("dynamic-update-slice", "scatter"):
                category, label, flops = "cache and state writes", f"{op} {shape.split('{')[0]}", 0.0
            elif op in ("reduce", "sort"):
                category = "argmax / top-k" if op == "sort" or shape.startswith("(") else "reductions (norms, softmax)"
                label, flops = f"{op} {shape.split('{')[0]}", 0.0
            else:
                continue
            kernels[normalize(name)] = HloKernel(name, category, label, flops)
    return kernels


def _stack_frames(hlo: str) -> dict[str, str]:
    """``{stack frame id: "file:line (function)"}`` of the frame itself (the call site nearest the op), from
    an HLO module's ``FileNames``, ``FunctionNames``, ``FileLocations`` and ``StackFrames`` tables."""
    tables: dict[str, dict[str, str]] = {}
    current = None
    for line in hlo.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
        elif current is not None and (m := re.match(r"(\d+)\s+(.*)$", line)):
            current[m.group(1)] = m.group(2)
        elif not line.strip() or line.startswith(("%", "ENTRY", "HloModule")):
            current = None
    files = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
    functions = {k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()}
    out = {}
    for frame, text in tables.get("StackFrames", {}).items():
        location = re.search(r"file_location_id=(\d+)", text)
        spec = tables.get("FileLocations", {}).get(location.group(1), "") if location else ""
        # ``\b``: ``line`` is not the end of ``end_line``
        file_id, function_id, line = (re.search(rf"\b{key}=(\d+)", spec)
                                      for key in ("file_name_id", "function_name_id", "line"))
        if file_id and line:
            function = functions.get(function_id.group(1), "?") if function_id else "?"
            out[frame] = f"{Path(files.get(file_id.group(1), '?')).name}:{line.group(1)} ({function})"
    return out


def op_sources(hlo: str) -> dict[str, str]:
    """Each instruction's JAX origin, by ``normalize``d name: its metadata's ``op_name`` (the jitted
    function's name dropped) and where it was traced (the stack frame nearest the op, or the older
    ``source_file:source_line``), what to read for a kernel a trace names."""
    frames = _stack_frames(hlo)
    out = {}
    roots: dict[str, str] = {}  # computation -> its ROOT instruction
    calls: dict[str, str] = {}  # fusion instruction -> the computation it calls
    computation = None
    for line in hlo.splitlines():
        head = _COMPUTATION_HEAD.match(line)
        if head and not line.startswith(" "):
            computation = head.group(1)
            continue
        parts = _split_instruction(line)
        if parts is None:
            continue
        if line.lstrip().startswith("ROOT") and computation is not None:
            roots[computation] = normalize(parts[0])
        if parts[2] == "fusion" and (called := re.search(r"calls=%?([\w.\-]+)", parts[4])):
            calls[normalize(parts[0])] = called.group(1)
        meta = re.search(r"metadata=\{([^}]*)\}", parts[4])
        if meta is None:
            continue
        op = re.search(r'op_name="([^"]+)"', meta.group(1))
        frame = re.search(r"stack_frame_id=(\d+)", meta.group(1))
        where = re.search(r'source_file="([^"]+)"\s+source_line=(\d+)', meta.group(1))
        text = op.group(1).split("/", 1)[-1] if op else ""
        if frame and frame.group(1) in frames:
            text += f" @ {frames[frame.group(1)]}"
        elif where:
            text += f" @ {Path(where.group(1)).name}:{where.group(2)}"
        if text:
            out[normalize(parts[0])] = text
    # A fusion XLA built without metadata of its own: its root's origin (a kernel named after the fusion
    # would otherwise match a neighbour by ``lookup``'s suffix rule, or nothing).
    for fusion, called in calls.items():
        root = roots.get(called)
        if fusion not in out and root in out:
            out[fusion] = out[root]
    return out


NOT_IN_HLO = "kernel"  # the label of a kernel matched to no HLO instruction: this and its name


def lookup(kernels: dict[str, HloKernel], name: str) -> HloKernel | None:
    """The instruction of a kernel name (or ``hlo_op``): the name itself, or without a suffix XLA may
    add to a fusion's kernel (``_impl``, a trailing ``_N``)."""
    key = normalize(name)
    for candidate in (key, re.sub(r"_impl$", "", key), re.sub(r"(_impl)?_\d+$", "", key)):
        if candidate in kernels:
            return kernels[candidate]
    return None


_LIBRARY_GEMM = re.compile(r"gemm|gemv|xmma|nvjet|cutlass|cublas|sm\d\d_", re.I)


def attribute(events: list[dict], kernels: dict[str, HloKernel]) -> list[dict]:
    """Each trace event (``name``, ``dur`` us, ``args``) with its category, label and FLOPs."""
    out = []
    for e in events:
        args = e.get("args") or {}
        found = None
        for key in (args.get("hlo_op"), args.get("long_name"), e["name"]):
            if key and (found := lookup(kernels, str(key))) is not None:
                break
        if found is None:  # by its name alone
            low = e["name"].lower()
            category = ("collectives" if "nccl" in low else
                        "attention" if "attention" in low or "attn" in low else
                        "GEMM" if _LIBRARY_GEMM.search(low) else
                        "reductions (norms, softmax)" if "norm" in low else
                        "argmax / top-k" if "argmax" in low or "topk" in low or "top_k" in low else
                        "cache and state writes" if "dynamic_update_slice" in low or "scatter" in low else
                        "copies and slices" if "copy" in low or "memcpy" in low or "memset" in low else "other")
            found = HloKernel(e["name"], category, f"{NOT_IN_HLO} {e['name'][:60]}")
        out.append(dict(name=e["name"], dur=e["dur"], category=found.category, label=found.label,
                        flops=found.flops, hlo=found.name, hlo_op=args.get("hlo_op")))
    return out


def summarize(attributed: list[dict], steps: float) -> dict:
    """Per category, and per (category, label) largest first: us, launches and FLOPs per step."""
    by_cat, by_label, names = {}, {}, {}
    for a in attributed:
        for table, key in ((by_cat, a["category"]), (by_label, (a["category"], a["label"]))):
            row = table.setdefault(key, dict(us=0.0, launches=0, flops=0.0))
            row["us"] += a["dur"] / steps
            row["launches"] += 1 / steps
            row["flops"] += a["flops"] / steps
        label_names = names.setdefault((a["category"], a["label"]), {})
        label_names[a["hlo"]] = label_names.get(a["hlo"], 0.0) + a["dur"]
    # Each label's instructions, the longest first: the fusions to look at in the HLO.
    labels = [dict(category=cat, label=label, **row, hlo=sorted(names[cat, label], key=lambda n: -names[cat, label][n])[:4])
              for (cat, label), row in by_label.items()]
    return dict(categories=by_cat, labels=sorted(labels, key=lambda r: -r["us"]),
                kernel_us=sum(r["us"] for r in by_cat.values()))


def roofline(tc, dc, batch: int, block: int, context: int, *, bytes_per_param: int = 2,
             peak_flops: float = H200_BF16_FLOPS, hbm: float = 4.3e12) -> list[dict]:
    """A decode step's ops, from the model's shapes: ``batch`` rows of ``block`` tokens (1: target-only;
    else a DFlash step, with the draft pass) at ``context``. Each op: FLOPs, bytes read and written,
    and the time each needs at ``peak_flops`` and ``hbm`` bytes/s."""
    t = batch * block
    h, hd, layers = tc.hidden_size, tc.head_dim, tc.num_layers
    qkv_n = (tc.num_heads + 2 * tc.num_kv_heads) * hd
    kv_token = 2 * tc.num_kv_heads * hd * bytes_per_param  # one layer's K and V of a token
    act = bytes_per_param

    def gemm(name, m, n, k, count):
        return dict(op=name, flops=2.0 * m * n * k * count, bytes=(k * n + m * k + m * n) * act * count)

    ops = [gemm("QKV", t, qkv_n, h, layers), gemm("O proj", t, h, tc.num_heads * hd, layers),
           gemm("gate-up", t, 2 * tc.intermediate_size, h, layers), gemm("down", t, h, tc.intermediate_size, layers),
           dict(op="attention (context + block)", flops=4.0 * t * tc.num_heads * hd * (context + block) * layers,
                bytes=batch * (context + block) * kv_token * layers + 2 * t * qkv_n * act * layers),
           dict(op="K/V cache writes", flops=0.0, bytes=t * kv_token * layers),
           dict(op="norms, residuals, SwiGLU (unfused bytes)", flops=0.0,
                bytes=layers * t * (8 * h + 3 * tc.intermediate_size) * act),
           gemm("LM head", t, tc.vocab_size, h, 1),
           dict(op="argmax (logits in the model's dtype)", flops=0.0, bytes=t * tc.vocab_size * act)]
    if block > 1 and dc is not None:
        drafts = batch * (block - 1)
        d_qkv = (dc.num_heads + 2 * dc.num_kv_heads) * dc.head_dim
        ops += [gemm("drafter QKV+O+MLP", t, d_qkv + dc.hidden_size + 3 * dc.intermediate_size, dc.hidden_size,
                     dc.num_layers),
                dict(op="drafter attention", flops=4.0 * t * dc.num_heads * dc.head_dim * (context + block) * dc.num_layers,
                     bytes=batch * context * 2 * dc.num_kv_heads * dc.head_dim * act * dc.num_layers),
                gemm("drafter LM head (draft logits)", drafts, tc.vocab_size, h, 1),
                dict(op="draft argmax", flops=0.0, bytes=drafts * tc.vocab_size * act),
                gemm("drafter fc (the block's taps)", t, h, len(dc.target_layer_ids) * h, 1),
                gemm("drafter context K/V of the block", t, 2 * dc.num_kv_heads * dc.num_layers * dc.head_dim, h, 1)]
    for op in ops:
        op["compute_s"], op["memory_s"] = op["flops"] / peak_flops, op["bytes"] / hbm
    return ops
