// The job page: reads the job over the REST API and follows its server-sent events
// (GET /v1/jobs/{id}/events) with fetch, so the bearer token can be sent; uPlot draws the
// loss chart (linear or log), one chart per metric the job reports, and, from the epochs'
// records (what the workers reported), each worker's share of the global batch (stacked),
// its compute and wait per step, and samples per second. Each chart's element carries its
// data in data-points (JSON), which the tests read beside uPlot's own (dynabatchCharts).
"use strict";
(() => {
  const jobId = document.body.dataset.jobId;
  const tokenRequired = document.body.dataset.tokenRequired === "true";
  const $ = (id) => document.getElementById(id);
  const TERMINAL = new Set(["SUCCEEDED", "FAILED", "CANCELLED"]);
  // A Ray node id (56 hex digits) by its first 8, as the CLI and /metrics name it
  // (dynabatch.service.cluster_client.node_label).
  const nodeLabel = (n) => (/^[0-9a-f]{40,}$/.test(n) ? n.slice(0, 8) : n);
  const PALETTE = ["#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
  // A link may carry the token in its fragment (/jobs/ID#token=...), which browsers never
  // send to the server; it is kept for the tab and taken out of the address bar.
  const fromLink = new URLSearchParams(location.hash.slice(1)).get("token");
  if (fromLink) {
    sessionStorage.setItem("dynabatch-token", fromLink);
    history.replaceState(null, "", location.pathname + location.search);
  }
  let token = sessionStorage.getItem("dynabatch-token") || "";
  let job = null;
  let authorized = false;
  const epochs = [];
  const charts = {};

  const headers = (json) => {
    const h = json ? { "Content-Type": "application/json" } : {};
    if (token) h.Authorization = "Bearer " + token;
    return h;
  };
  const fmt = (v, digits = 4) => (v === null || v === undefined ? "-" : Number(v).toFixed(digits));
  const cell = (row, text) => { const td = row.insertCell(); td.textContent = text; return td; };
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

  // A y axis as wide as its longest tick label (uPlot's default is a fixed 50 px: ticks
  // such as "120,000" ran into the axis label), measured in the axis's own font.
  function fitTicks(u, values, axisIdx, cycleNum) {
    const axis = u.axes[axisIdx];
    if (cycleNum > 1) return axis._size;  // settled: uPlot asks again while it lays out
    const longest = (values || []).reduce((a, v) => (String(v).length > a.length ? String(v) : a), "");
    u.ctx.font = axis.font[0];
    return Math.ceil(axis.ticks.size + axis.gap + u.ctx.measureText(longest).width / devicePixelRatio);
  }

  // A uPlot chart in element `id` (made again when its series or scales change: uPlot
  // fixes both at creation). `extra`: options merged in (scales, bands, axes).
  function chart(id, series, extra = {}) {
    const el = $(id);
    const old = charts[id];
    if (old) old.plot.destroy();
    const opts = {
      width: 500, height: 240, scales: { x: { time: false } },
      axes: [{ label: "epoch" }, {}],
      series: [{ label: "epoch" }, ...series],
      ...extra,
    };
    opts.axes = opts.axes.map((a, i) => (i ? { size: fitTicks, labelGap: 4, ...a } : a));
    opts.scales = { x: { time: false }, ...(extra.scales || {}) };
    const data = old && old.plot.data.length === series.length + 1
      ? old.plot.data : [[], ...series.map(() => [])];
    charts[id] = { el, plot: new uPlot(opts, data, el) };
  }

  // --- How the work is shared (from the epochs' records: what the workers reported) ---
  // Workers in the order they first appear in the history.
  function workerNames() {
    const names = [];
    for (const e of epochs) {
      for (const w of e.workers || []) if (!names.includes(w.worker)) names.push(w.worker);
    }
    return names;
  }
  const colorOf = (i) => PALETTE[i % PALETTE.length];
  const byWorker = (e) => Object.fromEntries((e.workers || []).map((w) => [w.worker, w]));
  const perStepMs = (w, key) => (w && w.steps ? (w[key] / w.steps) * 1e3 : null);

  // Each worker's share of the global batch, b_i / Σ_j b_j, stacked (as service/plots.py
  // draws it): a band thins as the policy moves work off a slow worker. data-points holds
  // the shares; uPlot draws their running sums, filled between neighbours.
  function drawShares(x, names) {
    const shares = names.map((n) => epochs.map((e) => {
      const ws = e.workers || [];
      const total = ws.reduce((s, w) => s + w.batch, 0);
      const w = ws.find((v) => v.worker === n);
      return total && w ? w.batch / total : 0;
    }));
    const key = names.join(",");
    if (charts["share-chart"].key !== key) {
      const series = names.map((n, i) => ({
        label: n, stroke: colorOf(i), fill: colorOf(i) + "99", width: 1,
        // The legend shows the share, not the running sum drawn.
        value: (u, v, si, di) => {
          const s = charts["share-chart"].shares;
          return di == null || !s ? "-" : s[si - 1][di].toFixed(3);
        },
      }));
      // Each band fills between a worker's running sum and the one below it.
      const bands = names.slice(1).map((_, i) => ({ series: [i + 2, i + 1] }));
      chart("share-chart", series, {
        bands, scales: { y: { range: [0, 1] } },
        axes: [{ label: "epoch" }, { label: "share of the global batch" }],
      });
      charts["share-chart"].key = key;
    }
    const stacked = [];
    let run = x.map(() => 0);
    for (const s of shares) { run = run.map((v, j) => v + s[j]); stacked.push(run); }
    charts["share-chart"].shares = shares;
    charts["share-chart"].plot.setData([x, ...stacked]);
    const el = charts["share-chart"].el;
    el.dataset.workers = JSON.stringify(names);
    el.dataset.points = JSON.stringify([x, ...shares]);
  }

  // Compute and wait per step, per worker (ms; wait dashed), and samples per second: each
  // worker's per compute-second and the job's per wall-second.
  function drawWorkerCharts(x, names) {
    const key = names.join(",");
    if (charts["time-chart"].key !== key) {
      chart("time-chart", names.flatMap((n, i) => [
        { label: `${n} compute`, stroke: colorOf(i), width: 2 },
        { label: `${n} wait`, stroke: colorOf(i), width: 2, dash: [6, 4] },
      ]), { axes: [{ label: "epoch" }, { label: "ms per step" }] });
      chart("throughput-chart", [
        ...names.map((n, i) => ({ label: `${n} per compute-s`, stroke: colorOf(i), width: 2 })),
        { label: "job per wall-s", stroke: "#222", width: 2, dash: [2, 3] },
      ], { axes: [{ label: "epoch" }, { label: "samples/s" }] });
      charts["time-chart"].key = charts["throughput-chart"].key = key;
    }
    const rows = epochs.map(byWorker);
    const time = [x, ...names.flatMap((n) => [
      rows.map((r) => perStepMs(r[n], "compute_s")),
      rows.map((r) => perStepMs(r[n], "wait_s")),
    ])];
    const rate = [x, ...names.map((n) => rows.map((r) => (r[n] ? r[n].throughput : null))),
                  epochs.map((e) => (e.wall_s ? e.samples_trained / e.wall_s : null))];
    for (const [id, d] of [["time-chart", time], ["throughput-chart", rate]]) {
      charts[id].plot.setData(d);
      charts[id].el.dataset.workers = JSON.stringify(names);
      charts[id].el.dataset.points = JSON.stringify(d);
    }
  }

  // The loss on a linear or a log scale (the checkbox; a log scale needs positive values).
  function lossChart() {
    const log = $("loss-log").checked;
    chart("loss-chart", [
      { label: "train loss", stroke: "#1f77b4", width: 2 },
      { label: "held-out loss", stroke: "#ff7f0e", width: 2 },
    ], { scales: { y: log ? { distr: 3 } : {} } });
    charts["loss-chart"].el.dataset.scale = log ? "log" : "linear";
  }

  // A record's held-out metrics by name (older records and parameter-server jobs may have
  // only test_accuracy).
  function metricsOf(e) {
    const m = { ...(e.test_metrics || {}) };
    if (m.accuracy === undefined && e.test_accuracy !== null && e.test_accuracy !== undefined) {
      m.accuracy = e.test_accuracy;
    }
    return m;
  }

  // A record's validation-split metrics (dataset.validation), keyed as their own charts.
  function validationOf(e) {
    return Object.fromEntries(Object.entries(e.validation_metrics || {})
      .map(([k, v]) => ["validation_" + k, v]));
  }

  // The chart of one metric, made the first time an epoch reports it.
  function metricChart(name) {
    const id = "metric-" + name.replace(/[^A-Za-z0-9_-]/g, "-");
    if (!charts[id]) {
      const fig = document.createElement("figure");
      const cap = document.createElement("figcaption");
      cap.textContent = name;
      const div = document.createElement("div");
      div.id = id;
      div.className = "chart";
      div.dataset.metric = name;
      fig.append(cap, div);
      $("charts").append(fig);
      const color = PALETTE[(Object.keys(charts).length - 1) % PALETTE.length];
      chart(id, [{ label: "held-out " + name, stroke: color, width: 2 }]);
    }
    return id;
  }

  function drawCharts() {
    const x = epochs.map((e) => e.epoch + 1);  // epochs are counted from 1 wherever a user reads them
    const data = {
      "loss-chart": [x, epochs.map((e) => e.train_loss), epochs.map((e) => e.test_loss)],
    };
    const all = (e) => ({ ...metricsOf(e), ...validationOf(e) });
    const names = new Set(epochs.flatMap((e) => Object.keys(all(e))));
    for (const name of [...names].sort()) {
      data[metricChart(name)] = [x, epochs.map((e) => all(e)[name] ?? null)];
    }
    if ($("loss-log").checked) {  // a log scale shows no value <= 0
      data["loss-chart"] = data["loss-chart"].map((s, i) => (i ? s.map(
        (v) => (v === null || v === undefined || v > 0 ? v : null)) : s));
    }
    for (const [id, d] of Object.entries(data)) {
      charts[id].plot.setData(d);
      charts[id].el.dataset.points = JSON.stringify(d);
    }
    const workers = workerNames();
    drawShares(x, workers);
    drawWorkerCharts(x, workers);
  }

  // Where the job is, as the server words it for every view (list and status say the
  // same): live, its epoch, and here its step; finished, how many epochs it completed.
  function progress(j) {
    const tail = ` · policy ${j.policy} · generation ${j.generation}`;
    if (TERMINAL.has(j.state)) {
      const when = j.finished_at ? ` · finished ${new Date(j.finished_at * 1000)
        .toISOString().replace("T", " ").slice(0, 19)} UTC` : "";
      return `${j.state.toLowerCase()}: ${j.progress}${when}${tail}`;
    }
    return `${j.progress} · step ${j.step}/${j.steps_per_epoch}${tail}`;
  }

  // Held-out metrics as the CLI shows them: each by its name in the job's spec.
  const scoresText = (m) => Object.entries(m || {}).map(([k, v]) => `${k} ${fmt(v)}`).join(", ");
  // Each split's metrics with the split named (telemetry.splits_text's words).
  const splitsText = (val, test) => [["validation", val], ["test", test]]
    .filter(([, m]) => Object.keys(m || {}).length)
    .map(([name, m]) => `${name} ${scoresText(m)}`).join("; ");

  // The latest epoch's held-out tables (a confusion matrix): rows are the true classes,
  // columns the predicted ones, as the record keeps them (test_matrices).
  function drawMatrices(e) {
    const box = $("matrices");
    const tables = Object.entries(e.test_matrices || {});
    if (!tables.length) return;
    box.replaceChildren();
    for (const [name, rows] of tables) {
      const h = document.createElement("h2");
      h.textContent = `${name}, epoch ${e.epoch + 1} (held-out set; rows: true class, ` +
        "columns: predicted)";
      const table = document.createElement("table");
      table.className = "matrix";
      const head = table.createTHead().insertRow();
      cell(head, "");
      rows.forEach((_, j) => { cell(head, j); });
      const body = table.createTBody();
      rows.forEach((r, i) => {
        const row = body.insertRow();
        cell(row, i);
        for (const v of r) cell(row, Number.isInteger(v) ? v : fmt(v));
      });
      box.append(h, table);
    }
  }

  function addEpoch(e) {
    epochs.push(e);
    const row = $("epochs").tBodies[0].insertRow();
    row.dataset.epoch = e.epoch;
    cell(row, e.epoch + 1);
    cell(row, fmt(e.wall_s, 2));
    cell(row, fmt(e.train_loss));
    cell(row, fmt(e.test_loss));
    cell(row, splitsText(e.validation_metrics, metricsOf(e)) || "-");
    cell(row, fmt(e.compute_balance, 3));
    cell(row, fmt(e.utilization, 3));
    // The time a step waited for its samples (0 when the loader's read-ahead hid it).
    const dw = e.breakdown ? e.breakdown.data_wait_s : null;
    cell(row, dw === null || dw === undefined ? "" : `${(dw * 1e3).toFixed(1)} ms`);
    cell(row, e.verified ? "yes" : "no");
    $("balance").textContent = fmt(e.compute_balance, 3);
    drawMatrices(e);
    drawCharts();
  }

  function showJob(j) {
    job = j;
    $("title").textContent = `${j.name} ${j.job_id}`;
    const st = $("state");
    st.textContent = j.state;
    st.className = "state " + j.state;
    $("emulated").hidden = !j.emulated;
    $("progress").textContent = progress(j);
    document.body.dataset.state = j.state;
    $("reason").textContent = j.reason || "";
    if (j.compute_balance !== null && j.compute_balance !== undefined) {
      $("balance").textContent = fmt(j.compute_balance, 3);
    }
    $("utilization").textContent = fmt(j.utilization, 3);
    $("train-loss").textContent = fmt(j.train_loss);
    $("metrics").textContent = splitsText(j.validation_metrics, j.test_metrics) || "-";
    $("rebalances").textContent = j.rebalances_total;
    const body = $("workers").tBodies[0];
    body.replaceChildren();
    // A parameter-server learner has no partition, step times or slowdown in its status.
    const measured = (text) => (j.ps ? "-" : text);
    for (const w of j.workers) {
      const row = body.insertRow();
      row.dataset.worker = w.worker;
      cell(row, w.worker);
      cell(row, nodeLabel(w.node));
      cell(row, w.batch).className = "batch";
      cell(row, measured(w.partition)).className = "partition";
      cell(row, measured(Math.round(w.throughput).toLocaleString("en")));
      cell(row, measured(`${(w.compute_s_per_step * 1e3).toFixed(1)} ms`));
      cell(row, measured(`${(w.wait_s_per_step * 1e3).toFixed(1)} ms`));
      cell(row, measured(fmt(w.slowdown, 1)));
    }
    const controls = $("controls");
    controls.hidden = !(authorized && !TERMINAL.has(j.state));
    if (!controls.hidden && document.activeElement !== $("scale-n")) {
      $("scale-n").value = j.workers.length || "";
    }
  }

  function log(line) {
    const pre = $("log");
    const t = new Date(line.time * 1000).toISOString().replace("T", " ").slice(0, 19);
    pre.append(`${t} ${line.level.padEnd(7)} ${line.message}\n`);
    pre.scrollTop = pre.scrollHeight;
  }

  function askToken(message) {
    $("auth").hidden = false;
    $("main").hidden = true;
    $("auth-error").textContent = message || "";
  }

  function notFound(message) {
    $("main").hidden = true;
    const p = $("notfound");
    p.hidden = false;
    p.textContent = message;
    document.title = "dynabatch: not found";
  }

  function parse(block) {
    let event = "message";
    const data = [];
    for (const line of block.split("\n")) {
      if (line.startsWith(":")) continue;
      const i = line.indexOf(":");
      const name = i < 0 ? line : line.slice(0, i);
      const value = i < 0 ? "" : line.slice(i + 1).replace(/^ /, "");
      if (name === "event") event = value;
      else if (name === "data") data.push(value);
    }
    return data.length ? { event, data: JSON.parse(data.join("\n")) } : null;
  }

  async function follow() {
    let since = 0;
    let epochsSince = 0;
    for (let failures = 0; failures < 30;) {
      let r;
      try {
        r = await fetch(`/v1/jobs/${jobId}/events?since=${since}&epochs_since=${epochsSince}`,
                        { headers: headers(false) });
      } catch (err) {
        failures++;
        await sleep(1000);
        continue;
      }
      if (r.status === 401) { askToken(token ? "That token is not valid." : ""); return; }
      if (r.status === 404) { notFound(`job ${jobId} not found`); return; }
      if (!r.ok) { failures++; await sleep(1000); continue; }
      authorized = true;
      document.body.dataset.authorized = "true";
      const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
      let buf = "";
      for (;;) {
        let chunk;
        try { chunk = await reader.read(); } catch (err) { break; }
        if (chunk.done) break;
        buf += chunk.value.replace(/\r\n/g, "\n");
        let i;
        while ((i = buf.indexOf("\n\n")) >= 0) {
          const ev = parse(buf.slice(0, i));
          buf = buf.slice(i + 2);
          if (!ev) continue;
          failures = 0;
          if (ev.event === "log") { log(ev.data); since = ev.data.seq + 1; }
          else if (ev.event === "epoch") { addEpoch(ev.data); epochsSince = ev.data.epoch + 1; }
          else if (ev.event === "job") showJob(ev.data);
          else if (ev.event === "end") {
            showJob(ev.data);
            document.body.dataset.streamEnded = "true";
            return;
          }
        }
      }
      failures++;
      await sleep(1000);
    }
  }

  async function act(path, body, what) {
    const msg = $("control-msg");
    msg.textContent = `${what}…`;
    const r = await fetch(path, { method: "POST", headers: headers(true),
                                  body: JSON.stringify(body) });
    const answer = await r.json().catch(() => ({}));
    if (!r.ok) {
      const detail = answer.detail;
      msg.textContent = `${what} failed: ` +
        (typeof detail === "string" ? detail : JSON.stringify(detail || r.status));
      return;
    }
    msg.textContent = `${what}: accepted`;
    showJob(answer);
  }

  $("cancel").addEventListener("click", () => {
    if (confirm("Cancel this job?")) {
      act(`/v1/jobs/${jobId}/cancel`, { reason: "cancelled from the web page" }, "cancel");
    }
  });
  $("scale").addEventListener("click", () => {
    const n = parseInt($("scale-n").value, 10);
    if (n >= 1) act(`/v1/jobs/${jobId}/scale`, { workers: n }, `scale to ${n}`);
  });
  $("token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    token = $("token").value.trim();
    sessionStorage.setItem("dynabatch-token", token);
    $("auth").hidden = true;
    $("main").hidden = false;
    follow();
  });

  lossChart();
  $("loss-log").addEventListener("change", () => { lossChart(); drawCharts(); });
  for (const id of ["share-chart", "time-chart", "throughput-chart"]) chart(id, []);
  // The charts, for the page's tests (tests/e2e): what uPlot holds and draws.
  window.dynabatchCharts = charts;
  if (tokenRequired && !token) askToken(""); else follow();
})();
