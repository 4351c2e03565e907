// The job page's placement line: what the cluster scheduler decided for this job (its
// allocation) beside what the job has (its members, as it last reported them to the
// scheduler), and why they differ, from GET /v1/cluster: the same answer `dynabatch
// cluster` and Grafana show. Hidden when no scheduler runs or it does not hold the job.
"use strict";
(() => {
  const jobId = document.body.dataset.jobId;
  const $ = (id) => document.getElementById(id);
  const TERMINAL = new Set(["SUCCEEDED", "FAILED", "CANCELLED"]);
  const nodeLabel = (n) => (/^[0-9a-f]{40,}$/.test(n) ? n.slice(0, 8) : n);
  const slots = (list) => (list && list.length
    ? list.map((s) => `${nodeLabel(s.node_id)}: ${s.workers}`).join(", ") : "none");
  const total = (list) => (list || []).reduce((a, s) => a + s.workers, 0);

  // One line, as the CLI's jobs table has it.
  function describe(j) {
    if (j.position !== null) return `queued (position ${j.position}): ${j.reason}`;
    let text = `allocated ${j.workers} (${slots(j.allocation)})`;
    text += j.members === null ? "; members not reported yet"
      : `; members ${total(j.members)} (${slots(j.members)})`;
    if (j.differs) text += `; differs: ${j.differs}`;
    if (j.waits) text += `; waits: ${j.waits}`;
    return text;
  }

  async function poll() {
    for (;;) {
      const el = $("placement");
      const token = sessionStorage.getItem("dynabatch-token") || "";
      try {
        const r = await fetch("/v1/cluster",
          { headers: token ? { Authorization: "Bearer " + token } : {} });
        const body = r.ok ? await r.json() : null;
        const j = body && (body.jobs || []).find((x) => x.job_id === jobId);
        el.hidden = !j;
        el.textContent = j ? "cluster scheduler: " + describe(j) : "";
      } catch (err) {
        // The job's own poll reports a lost service; this line keeps what it showed.
      }
      if (TERMINAL.has($("state").textContent)) return;
      await new Promise((r) => setTimeout(r, 2000));
    }
  }
  poll();
})();
