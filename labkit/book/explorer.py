"""A roofline explorer that works in a static web page: inline SVG + vanilla JavaScript.

`explorer_html(machine, ops)` returns a self-contained HTML snippet (no external scripts,
styles or fonts; element ids unique per snippet) with sliders for the three ceilings (peak
GFLOP/s, bandwidth GB/s, overhead in microseconds) and for a GEMM shape (m, n, k). Moving a
slider recomputes, in the browser, the prediction

    t = overhead + max(F / peak, B / bandwidth)

for the GEMM and for every op of a precomputed table, and redraws the roofline. The
snippet is seeded with a measured machine; `explorer_rows` computes the same table in
Python (with labkit.sim.roofline.predict) so tests can check the page's numbers.
"""

from __future__ import annotations

import html
import json
import uuid

from labkit.sim.roofline import Machine, Op, matmul_op, predict


def explorer_predict(flops: float, nbytes: float, peak_gflops: float, bandwidth_gbs: float,
                     overhead_us: float) -> float:
    """The formula the page's JavaScript evaluates, in seconds (slider units in, SI out)."""
    return overhead_us * 1e-6 + max(flops / (peak_gflops * 1e9), nbytes / (bandwidth_gbs * 1e9))


def explorer_rows(machine: Machine, ops: list[dict]) -> list[dict]:
    """The precomputed table: name, flops, bytes, measured_s (may be None), predicted_s."""
    rows = []
    for o in ops:
        op = Op(o["name"], float(o["flops"]), float(o["bytes"]))
        rows.append({"name": op.name, "flops": op.flops, "bytes": op.bytes,
                     "measured_s": o.get("measured_s"), "predicted_s": predict(op, machine)})
    return rows


_TEMPLATE = r"""
<div id="__ID__" class="roofline-explorer" style="font-family:sans-serif;font-size:13px;max-width:760px;border:1px solid #ccc;padding:8px;border-radius:6px">
<div style="display:grid;grid-template-columns:170px 1fr 120px;gap:2px 8px;align-items:center">
<label for="__ID__-peak">peak (GFLOP/s)</label><input type="range" id="__ID__-peak" min="0" max="5" step="0.01" value="__PEAK__"><span id="__ID__-peak-v"></span>
<label for="__ID__-bw">bandwidth (GB/s)</label><input type="range" id="__ID__-bw" min="-1" max="4" step="0.01" value="__BW__"><span id="__ID__-bw-v"></span>
<label for="__ID__-ovh">overhead (&micro;s)</label><input type="range" id="__ID__-ovh" min="-1" max="3" step="0.01" value="__OVH__"><span id="__ID__-ovh-v"></span>
<label for="__ID__-m">GEMM m (rows, batch)</label><input type="range" id="__ID__-m" min="0" max="13" step="1" value="0"><span id="__ID__-m-v"></span>
<label for="__ID__-n">GEMM n (outputs)</label><input type="range" id="__ID__-n" min="0" max="16" step="1" value="__N__"><span id="__ID__-n-v"></span>
<label for="__ID__-k">GEMM k (inputs)</label><input type="range" id="__ID__-k" min="0" max="16" step="1" value="__K__"><span id="__ID__-k-v"></span>
</div>
<p id="__ID__-out" style="margin:6px 0;font-weight:bold"></p>
<svg id="__ID__-svg" viewBox="0 0 520 300" width="100%" style="max-width:620px;background:#fff" role="img" aria-label="roofline"></svg>
<table id="__ID__-tab" style="border-collapse:collapse;font-size:12px"><thead><tr><th style="text-align:left">op</th><th>predicted (ms)</th><th>measured here (ms)</th><th>measured / predicted</th></tr></thead><tbody></tbody></table>
<script type="application/json" id="__ID__-data">__DATA__</script>
<script>
(function(){
var id="__ID__", data=JSON.parse(document.getElementById(id+"-data").textContent);
function $(s){return document.getElementById(id+"-"+s);}
function predict(f,b,peak,bw,ovh){return ovh*1e-6+Math.max(f/(peak*1e9),b/(bw*1e9));}
function fmt(x){return x>=100?x.toFixed(0):x>=10?x.toFixed(1):x>=1?x.toFixed(2):x.toPrecision(2);}
var W=520,H=300,L=55,R=10,T=10,Bm=40,ix=[-2,3],iy=[-1,5];
function X(v){return L+(Math.log10(v)-ix[0])/(ix[1]-ix[0])*(W-L-R);}
function Y(v){return H-Bm-(Math.log10(v)-iy[0])/(iy[1]-iy[0])*(H-T-Bm);}
function el(tag,attrs,text){var e=document.createElementNS("http://www.w3.org/2000/svg",tag);for(var a in attrs)e.setAttribute(a,attrs[a]);if(text!==undefined)e.textContent=text;return e;}
function update(){
  var peak=Math.pow(10,+$("peak").value), bw=Math.pow(10,+$("bw").value), ovh=Math.pow(10,+$("ovh").value);
  var m=Math.pow(2,+$("m").value), n=Math.pow(2,+$("n").value), k=Math.pow(2,+$("k").value);
  $("peak-v").textContent=fmt(peak); $("bw-v").textContent=fmt(bw); $("ovh-v").textContent=fmt(ovh);
  $("m-v").textContent=m; $("n-v").textContent=n; $("k-v").textContent=k;
  var f=2*m*n*k, b=data.itemsize*(m*k+k*n+m*n), t=predict(f,b,peak,bw,ovh);
  var c=f/(peak*1e9), mem=b/(bw*1e9), which=ovh*1e-6>Math.max(c,mem)?"overhead":(c>=mem?"compute":"memory");
  $("out").textContent="GEMM "+m+"x"+k+"x"+n+": "+fmt(f/1e6)+" MFLOP, "+fmt(b/1e6)+" MB, intensity "+fmt(f/b)+" FLOP/B; predicted "+fmt(t*1e3)+" ms ("+which+"-bound), "+fmt(f/t/1e9)+" GFLOP/s attained";
  var svg=$("svg"); while(svg.firstChild) svg.removeChild(svg.firstChild);
  svg.appendChild(el("rect",{x:L,y:T,width:W-L-R,height:H-T-Bm,fill:"none",stroke:"#999"}));
  for(var e=ix[0];e<=ix[1];e++){svg.appendChild(el("text",{x:X(Math.pow(10,e)),y:H-Bm+14,"font-size":10,"text-anchor":"middle"},"1e"+e));}
  for(var e2=iy[0];e2<=iy[1];e2++){svg.appendChild(el("text",{x:L-4,y:Y(Math.pow(10,e2))+3,"font-size":10,"text-anchor":"end"},"1e"+e2));}
  svg.appendChild(el("text",{x:(L+W-R)/2,y:H-6,"font-size":11,"text-anchor":"middle"},"arithmetic intensity (FLOP/byte)"));
  svg.appendChild(el("text",{x:12,y:(T+H-Bm)/2,"font-size":11,"text-anchor":"middle",transform:"rotate(-90 12 "+((T+H-Bm)/2)+")"},"attainable GFLOP/s"));
  var pts=[];for(var i=0;i<=100;i++){var a=Math.pow(10,ix[0]+i/100*(ix[1]-ix[0]));var g=Math.min(peak,a*bw);if(g>=Math.pow(10,iy[0]))pts.push(X(a)+","+Y(Math.min(g,Math.pow(10,iy[1]))));}
  svg.appendChild(el("polyline",{points:pts.join(" "),fill:"none",stroke:"#1f77b4","stroke-width":2}));
  data.ops.forEach(function(o){ if(!o.measured_s||!o.flops) return; var a=o.flops/o.bytes, g=o.flops/o.measured_s/1e9;
    if(a<Math.pow(10,ix[0])||a>Math.pow(10,ix[1])||g<Math.pow(10,iy[0])||g>Math.pow(10,iy[1])) return;
    var d=el("circle",{cx:X(a),cy:Y(g),r:2.5,fill:"#888"}); d.appendChild(el("title",{},o.name)); svg.appendChild(d);});
  var ga=f/b, gg=f/t/1e9;
  if(ga>=Math.pow(10,ix[0])&&ga<=Math.pow(10,ix[1])&&gg>=Math.pow(10,iy[0])&&gg<=Math.pow(10,iy[1]))
    svg.appendChild(el("circle",{cx:X(ga),cy:Y(gg),r:5,fill:"#d62728"}));
  var rows=data.ops.map(function(o){var p=predict(o.flops,o.bytes,peak,bw,ovh);
    return "<tr><td>"+o.label+"</td><td style='text-align:right'>"+fmt(p*1e3)+"</td><td style='text-align:right'>"+(o.measured_s?fmt(o.measured_s*1e3):"")+"</td><td style='text-align:right'>"+(o.measured_s?fmt(o.measured_s/p):"")+"</td></tr>";});
  $("tab").tBodies[0].innerHTML=rows.join("");
}
["peak","bw","ovh","m","n","k"].forEach(function(s){$(s).addEventListener("input",update);});
update();
})();
</script>
</div>
"""


def explorer_html(machine: Machine, ops: list[dict], *, uid: str | None = None,
                  gemm_nk: tuple[int, int] = (576, 576)) -> str:
    """A self-contained HTML snippet: sliders + inline SVG roofline + op table, no CDN.

    `ops` are dicts with name, flops, bytes and optionally measured_s (seconds). The
    sliders start at `machine`'s ceilings; the GEMM sliders (powers of two) start at m=1
    and the powers of two nearest `gemm_nk`.
    """
    import math

    uid = uid or f"rfx-{uuid.uuid4().hex[:10]}"
    rows = explorer_rows(machine, ops)
    for r in rows:
        r["label"] = html.escape(r["name"])
    data = {"machine": machine.to_dict(), "itemsize": 4, "ops": rows,
            "defaults": {"peak_gflops": machine.peak_flops / 1e9,
                         "bandwidth_gbs": machine.bandwidth / 1e9,
                         "overhead_us": machine.overhead * 1e6}}
    blob = json.dumps(data).replace("</", "<\\/")
    sub = {"__PEAK__": f"{math.log10(machine.peak_flops / 1e9):.2f}",
           "__BW__": f"{math.log10(machine.bandwidth / 1e9):.2f}",
           "__OVH__": f"{math.log10(machine.overhead * 1e6):.2f}",
           "__N__": str(round(math.log2(gemm_nk[0]))), "__K__": str(round(math.log2(gemm_nk[1]))),
           "__DATA__": blob, "__ID__": uid}
    out = _TEMPLATE
    for key in ("__PEAK__", "__BW__", "__OVH__", "__N__", "__K__", "__DATA__", "__ID__"):
        out = out.replace(key, sub[key])
    return out


def gemm_prediction(machine: Machine, m: int, n: int, k: int) -> tuple[float, str]:
    """(predicted seconds, bound) of an [m, k] x [k, n] float32 GEMM: the explorer's readout."""
    from labkit.sim.roofline import bound
    op = matmul_op(m, n, k)
    return predict(op, machine), bound(op, machine)


# -- static figures (matplotlib) for the chapter's roofline ------------------------------------
KINDS = ("gemm", "gemv", "bmm", "elementwise", "softmax", "rmsnorm", "gather", "copy",
         "gemv from memory")


def kind_color(kind: str) -> str:
    """One colour per op kind, the same in every panel (lines keep the style's cycle)."""
    palette = ("#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d",
               "#666666", "#1f78b4")
    return palette[KINDS.index(kind) % len(palette)] if kind in KINDS else "#000000"


def plot_roofline(ax, machines: dict[str, Machine], points=None, *, intensity=(1e-2, 1e3)) -> None:
    """Log-log roofline: attainable FLOP/s = min(peak, intensity x bandwidth) per machine.

    `points` is an optional DataFrame with columns intensity, flops, measured_s and kind:
    each op is drawn at its arithmetic intensity and the FLOP/s it attained here.
    """
    import numpy as np

    x = np.logspace(np.log10(intensity[0]), np.log10(intensity[1]), 200)
    for (label, m), style in zip(machines.items(), ("-", "--", ":")):
        ax.plot(x, np.minimum(m.peak_flops, x * m.bandwidth), style, lw=2,
                label=f"roofline, {label}")
        ax.axvline(m.ridge_point, color="0.6", lw=0.8, ls=style)
    if points is not None:
        pts = points[points["flops"] > 0]
        for kind, g in pts.groupby("kind"):
            ax.scatter(g["intensity"], g["flops"] / g["measured_s"], s=14, label=kind, alpha=0.8,
                       color=kind_color(kind))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("attainable FLOP/s")
    ax.legend(fontsize=7, ncol=2)


def plot_time_panel(ax, machine: Machine, points=None, *, nbytes=(1e2, 2e8)) -> None:
    """Time vs bytes moved for memory-bound ops: overhead floor + B / bandwidth line.

    The overhead ceiling is invisible on a FLOP/s roofline; on a time axis it is the floor
    that small ops sit on. `points` (DataFrame: bytes, measured_s, bound, kind) adds the
    measured ops the model calls memory- or overhead-bound.
    """
    import numpy as np

    b = np.logspace(np.log10(nbytes[0]), np.log10(nbytes[1]), 200)
    ax.plot(b, machine.overhead + b / machine.bandwidth, lw=2, label="overhead + bytes / bandwidth")
    ax.axhline(machine.overhead, color="0.5", ls="--", lw=1, label="overhead ceiling")
    if points is not None:
        pts = points[points["bound"] != "compute"]
        for kind, g in pts.groupby("kind"):
            ax.scatter(g["bytes"], g["measured_s"], s=14, label=kind, alpha=0.8,
                       color=kind_color(kind))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes moved (B)")
    ax.set_ylabel("time per call (s)")
    ax.legend(fontsize=7)


def plot_predicted_vs_measured(ax, table) -> None:
    """Measured vs predicted seconds per op (log-log) with the diagonal and 2x bands."""
    import numpy as np

    lo = min(table["predicted_s"].min(), table["measured_s"].min()) / 2
    hi = max(table["predicted_s"].max(), table["measured_s"].max()) * 2
    x = np.array([lo, hi])
    ax.plot(x, x, color="0.2", lw=1, label="measured = predicted")
    ax.fill_between(x, x / 2, x * 2, color="0.85", label="within 2x")
    for kind, g in table.groupby("kind"):
        ax.scatter(g["predicted_s"], g["measured_s"], s=16, label=kind, alpha=0.85,
                   color=kind_color(kind))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("predicted time (s)")
    ax.set_ylabel("measured time (s)")
    ax.legend(fontsize=7, ncol=2)


HEADLESS_ENV = "LABKIT_HEADLESS"


def running_headless(markers: tuple[str, ...] = ("papermill", "labkit", "pytest", "nbclient",
                                                 "jupyter-nbconvert", "jupyter-book")) -> bool:
    """True when this kernel was started by a batch executor rather than a live frontend.

    The book's runner (papermill) saves the state of any ipywidget it sees into the
    notebook, and myst-nb then loads the widget manager from a CDN on the page. The
    chapter therefore builds its widgets only in a live Jupyter or Colab session.
    `LABKIT_HEADLESS=1|0` decides when set (the book runner and `make test` set it);
    otherwise we look at the command line of the kernel's parent process (Linux /proc;
    False elsewhere).
    """
    import os

    flag = os.environ.get(HEADLESS_ENV, "").strip().lower()
    if flag in ("1", "true", "yes"):
        return True
    if flag in ("0", "false", "no"):
        return False
    return any(m in parent_command_line() for m in markers)


def parent_command_line() -> str:
    """The parent process's command line, '' where /proc is not available."""
    import os

    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
