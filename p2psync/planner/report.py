"""`p2psync plan` output: text, JSON, and the per-NIC load picture."""

from __future__ import annotations

from statistics import mean
from typing import Any

from .predict import Prediction

GB = 1e9


def _gb(n: float) -> str:
    return f"{n / GB:.2f} GB"


def to_dict(p: Prediction, model: str) -> dict[str, Any]:
    c = p.cluster
    sends = list(p.sender_bytes.values())
    recvs = list(p.receiver_bytes.values())
    active = [b for b in sends if b]
    return {
        "model": model,
        "shapes": p.shapes.source,
        "parameters": p.shapes.numel_total,
        "cluster": c.to_dict(),
        "link_model": p.link_model,
        "broadcast_model": p.broadcast_model,
        "plan_build_s": p.build_s,
        "stages": [
            {"stage": s, "senders": len(c.stage_ranks(s)), "layers": [r.start, r.stop - 1] if len(r) else [],
             "full_bytes_engine_dtype": p.stage_full_bytes[s],
             "targets": len(p.plans[s].assignment),
             "senders_used": sum(1 for v in p.plans[s].load.values() if v)}
            for s in range(c.train_pp) for r in [c.stage_layers(s, len(p.shapes.layer_kinds))]
        ],
        "p2p": {
            "predicted_s": p.p2p_s,
            "lower_bound_s": p.lower_bound_s,
            "plan_independent_floor_s": p.floor_s,
            "sender_bytes": {"max": max(sends), "mean": mean(sends), "mean_active": mean(active) if active else 0,
                             "active": len(active), "total": sum(sends)},
            "receiver_bytes": {"max": max(recvs), "min": min(recvs), "mean": mean(recvs)},
            "nic_send_bytes": {_nic(k): v for k, v in sorted(p.nic_send.items())},
            "nic_recv_bytes": {_nic(k): v for k, v in sorted(p.nic_recv.items())},
        },
        "broadcast": {
            "predicted_s": p.broadcast_s,
            "receiver_bytes": max(p.bcast_nic_recv.values()),
            "nic_send_bytes": {_nic(k): v for k, v in sorted(p.bcast_nic_send.items())},
            "nic_recv_bytes": {_nic(k): v for k, v in sorted(p.bcast_nic_recv.items())},
        },
        "broadcast_over_p2p": p.broadcast_s / p.p2p_s,
        "assignment": {str(t): s for plan in p.plans for t, s in plan.assignment.items()} if len(recvs) <= 64 else None,
    }


def _nic_order(name: str) -> tuple[int, int, int]:
    side, node, nic = name.split("-")
    return (0 if side == "trainer" else 1, int(node.removeprefix("node")), int(nic.removeprefix("nic")))


def _nic(k: tuple[str, int, int]) -> str:
    return f"{k[0]}-node{k[1]}-nic{k[2]}"


def format_text(d: dict[str, Any]) -> str:
    c = d["cluster"]
    p2p, b = d["p2p"], d["broadcast"]
    lines = [
        f"p2psync plan: {d['model']} ({d['parameters'] / 1e9:.1f}B parameters), {d['shapes']}",
        f"  trainer: {c['train_ranks']} ranks on {c['train_nodes']} nodes, TP{c['train_tp']} PP{c['train_pp']} "
        f"EP{c['train_ep']} ETP{c['train_etp']}, {c['trainer_dtype']}: {c['train_pp']} sender groups of "
        f"{c['stage_size']}",
        f"  engines: {c['engines']} x TP{c['engine_tp']} EP{c['engine_ep']} ({c['engine_ranks']} ranks on "
        f"{c['engine_nodes']} nodes), {c['engine_dtype']}",
        f"  network: {c['nics_per_node']} NICs per node x {c['nic_gbps']:g} Gb/s, {c['gpus_per_node']} GPUs per node",
        f"  link model: {d['link_model']}",
        "",
        f"  stage  layers     senders used  full bytes (engine dtype)  held gathered ({c['trainer_dtype']})",
    ]
    for s in d["stages"]:
        lay = f"{s['layers'][0]}-{s['layers'][1]}" if s["layers"] else "-"
        used = f"{s['senders_used']:>4}/{s['senders']:<6}"
        held = _gb(s["held_bytes_trainer_dtype"]) if "held_bytes_trainer_dtype" in s else "-"
        lines.append(f"  {s['stage']:>5}  {lay:<9}  {used}  {_gb(s['full_bytes_engine_dtype']):<25}  {held}")
    sb, rb = p2p["sender_bytes"], p2p["receiver_bytes"]
    lines += [
        "",
        f"  P2P bytes per sender: max {_gb(sb['max'])}, mean {_gb(sb['mean'])} (over the {sb['active']} senders that "
        f"send: {_gb(sb['mean_active'])}), total {_gb(sb['total'])}",
        f"  P2P bytes per engine rank: max {_gb(rb['max'])}, min {_gb(rb['min'])}",
        f"  broadcast bytes per engine rank: {_gb(b['receiver_bytes'])}",
        f"  most loaded NIC: P2P send {_gb(max(p2p['nic_send_bytes'].values()))}, receive "
        f"{_gb(max(p2p['nic_recv_bytes'].values()))}; broadcast send {_gb(max(b['nic_send_bytes'].values()))}, "
        f"receive {_gb(max(b['nic_recv_bytes'].values()))}",
        "",
        "  predicted update time (a prediction from the link model, not a measurement):",
        f"    P2P        {p2p['predicted_s']:8.3f} s   (lower bound for this plan {p2p['lower_bound_s']:.3f} s; "
        f"for any plan {p2p['plan_independent_floor_s']:.3f} s)",
        f"    broadcast  {b['predicted_s']:8.3f} s   ({d['broadcast_model']})",
        f"    broadcast / P2P = {d['broadcast_over_p2p']:.1f}x",
        *_update_lines(d),
        f"  plan built in {d['plan_build_s']:.3f} s: shapes {d.get('shapes_s', 0):.3f} s (with imports), "
        f"{c['train_pp']} real plans + loads {d.get('plans_s', d['plan_build_s']):.3f} s",
    ]
    return "\n".join(lines)


def _update_lines(d: dict[str, Any]) -> list[str]:
    """The whole update per way, part by part, and the published times of a `--setup`."""
    u = d["update"]
    lines = [
        "",
        "  predicted whole update (a prediction, not a measurement), seconds:",
        f"    {'way':<13} {'gathers':>7} {'production':>11} {'wire':>8} {'pause':>6} {'finish':>7} {'post-load':>10} "
        f"{'total':>8}",
    ]
    for name, w in u["ways"].items():
        production = w["production_s"] + w.get("compare_s", 0.0)
        post_load = w["post_load_s"] + w.get("apply_s", 0.0)
        lines.append(
            f"    {name:<13} {w['gathers_s']:>7.3f} {production:>11.3f} {w['wire_s']:>8.3f} {w['pause_s']:>6.2f} "
            f"{w['finish_s']:>7.2f} {post_load:>10.3f} {w['total_s']:>8.3f}"
        )
    lines.append(f"  whole-update model: {u['model']}")
    delta = u["ways"].get("p2psync-delta")
    if delta is not None:
        lines.append(
            f"  p2psync-delta: production includes {delta['compare_s']:.3f} s of comparing with baselines; "
            f"post-load includes {delta['apply_s']:.3f} s of applying patches; {delta['model']}"
        )
    for p in d.get("published", []):
        low, high = p["low_s"], p["high_s"]
        when = f"{low:g}" if low == high else f"{low:g}-{high:g}"
        lines.append(f"  published ({p['system']}, way {p['way']}): {when} s")
    if d.get("assumed"):
        lines.append(f"  ASSUMED: {d['assumed']}")
    return lines


def draw_png(d: dict[str, Any], path: str) -> None:
    """Bars of bytes per NIC: P2P send/receive and broadcast send/receive."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("--png needs matplotlib: pip install matplotlib") from exc
    fig, axes = plt.subplots(2, 1, figsize=(12, 7), sharey=False)
    ways = (("P2P", d["p2p"]), (f"broadcast ({d['broadcast_model']})", d["broadcast"]))
    names = {n for _, sub in ways for key in ("nic_send_bytes", "nic_recv_bytes") for n in sub[key]}
    nics = sorted(names, key=_nic_order)
    for ax, (way, sub) in zip(axes, ways):
        x = range(len(nics))
        for label, key, color, off in (("send", "nic_send_bytes", "tab:blue", -0.2),
                                       ("receive", "nic_recv_bytes", "tab:orange", 0.2)):
            ax.bar([i + off for i in x], [sub[key].get(n, 0) / GB for n in nics], width=0.4, label=label, color=color)
        n_train = sum(1 for n in nics if n.startswith("trainer"))
        ax.axvline(n_train - 0.5, color="grey", linestyle=":")
        ax.set_title(f"{way}: predicted {sub['predicted_s']:.2f} s (a prediction from the link model)")
        ax.set_ylabel("GB through NIC")
        ax.set_xlim(-1, len(nics))
        ax.legend(loc="upper right")
    axes[-1].set_xlabel("NICs: trainer nodes (left of the dotted line), then engine nodes; node by node, NIC by NIC")
    fig.suptitle(f"{d['model']}: per-NIC load, {d['shapes']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
