// The profile page's live plan: a budget slider whose plan (POST /api/plan, solved as `agoq search` would)
// is redrawn as it moves, and a button saving the plan shown (POST /api/plan/save). The last plan drawn is
// window.agoqPlanner.current (null, and nothing drawn, once a budget gets no plan); body[data-plans-drawn]
// counts the plans drawn. The slider starts from the settings in #planner's data-start (those of the plan made
// from this profile: its budget, objective, error cap, layout and gradient storage; {}: agoq search's defaults).
(function () {
  "use strict";
  var STEPS = 1000;
  var DEBOUNCE_MS = 200;

  function bytes(n, digits) {
    if (n === null || n === undefined || !isFinite(n)) return "–";
    var units = ["B", "KiB", "MiB", "GiB", "TiB"];
    var i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return i === 0 ? String(Math.round(n)) + " B" : n.toFixed(digits === undefined ? 2 : digits) + " " + units[i];
  }
  // two byte counts with enough decimals (up to 4) that different counts read differently, else exact bytes
  function bytesApart(a, b) {
    for (var d = 2; d <= 4; d++) {
      var x = bytes(a, d), y = bytes(b, d);
      if (x !== y || a === b) return [x, y];
    }
    return [String(Math.round(a)) + " B", String(Math.round(b)) + " B"];
  }
  function seconds(s) {
    if (s === null || s === undefined) return "–";
    return s < 1 ? (s * 1e3).toFixed(2) + " ms" : s.toFixed(3) + " s";
  }
  function num(x, digits) {
    if (x === null || x === undefined) return "–";
    return typeof x === "number" ? Number(x.toPrecision(digits || 4)).toString() : String(x);
  }
  function el(tag, text, cls) {
    var e = document.createElement(tag);
    if (text !== undefined) e.textContent = text;
    if (cls) e.className = cls;
    return e;
  }
  function table(headers, row) {
    var t = el("table"), head = el("tr"), body = el("tr");
    headers.forEach(function (h) { head.appendChild(el("th", h)); });
    row.forEach(function (c) { body.appendChild(el("td", c)); });
    var thead = el("thead"), tbody = el("tbody");
    thead.appendChild(head); tbody.appendChild(body);
    t.appendChild(thead); t.appendChild(tbody);
    var wrap = el("div", undefined, "scroll");
    wrap.appendChild(t);
    return wrap;
  }
  function detailText(body, status) {
    var d = body && body.detail;
    if (d && typeof d === "object" && !Array.isArray(d)) return d.message || JSON.stringify(d);
    if (Array.isArray(d)) return d.map(function (x) { return (x.loc || []).join(".") + ": " + x.msg; }).join("; ");
    return d ? String(d) : "HTTP " + status;
  }

  function start() {
    var root = document.getElementById("planner");
    if (!root) return;
    var profile = root.dataset.profile;
    var slider = document.getElementById("plan-budget");
    var budgetText = document.getElementById("plan-budget-text");
    var objective = document.getElementById("plan-objective");
    var layout = document.getElementById("plan-layout");
    var gradients = document.getElementById("plan-gradients");
    var start = {};
    try { start = JSON.parse(root.dataset.start || "{}") || {}; } catch (e) { start = {}; }
    var status = document.getElementById("plan-status");
    var result = document.getElementById("plan-result");
    var saveButton = document.getElementById("plan-save");
    var nameInput = document.getElementById("plan-name");
    var saved = document.getElementById("plan-saved");
    // pinned: the start plan's own budget, asked for exactly until the slider is moved
    var state = {low: 0, high: 0, seq: 0, timer: null, controller: null, current: null, drawn: 0, pinned: null};
    window.agoqPlanner = state;

    function say(text, kind) {
      status.hidden = !text;
      status.className = "msg " + (kind || "info");
      status.textContent = text || "";
    }
    function budget() {
      if (state.pinned !== null) return state.pinned;
      return Math.round(state.low + (state.high - state.low) * Number(slider.value) / STEPS);
    }
    function request() {
      var body = {profile: profile, budget: budget()};
      if (objective.value) body.objective = objective.value;
      if (layout.value && layout.value !== "any") body.layout = layout.value;
      if (gradients.value && gradients.value !== "any") body.gradients = gradients.value;
      if (start.error_cap !== undefined && start.error_cap !== null) body.error_cap = start.error_cap;
      return body;
    }
    function post(url, body, signal) {
      return fetch(url, {method: "POST", headers: {"content-type": "application/json"},
                         body: JSON.stringify(body), signal: signal, credentials: "same-origin"})
        .then(function (r) { return r.json().catch(function () { return {}; }).then(function (j) {
          return {status: r.status, body: j, retry: Number(r.headers.get("retry-after") || 0)};
        }); });
    }

    function draw(answer) {
      state.current = answer;
      var p = answer.predicted, view = answer.view;
      var figures = document.getElementById("plan-figures");
      figures.textContent = "";
      figures.appendChild(table(
        ["budget", "predicted peak", "predicted step", "tokens/s", "gradient error", "objective", "solved in"],
        [bytes(answer.budget_bytes) + " (" + answer.budget_bytes + " B)", bytes(p.peak_bytes), seconds(p.step_seconds),
         num(p.tokens_per_second, 5), num(p.grad_error), String(answer.caps.objective),
         answer.cached ? "cached" : seconds(answer.solve_seconds)]));
      (answer.notes || []).forEach(function (n) { figures.appendChild(el("div", n, "msg info")); });
      drawAlternative(answer.alternative, p);
      var config = {responsive: true, displaylogo: false};
      result.hidden = false;
      var jobs = [Plotly.react("plan-bits", view.figures.bits.data, view.figures.bits.layout, config),
                  Plotly.react("plan-memory", view.figures.memory.data, view.figures.memory.layout, config)];
      if (!nameInput.dataset.edited) nameInput.value = suggestedName(answer.budget_bytes);
      return Promise.all(jobs).then(function () {
        state.drawn += 1;
        document.body.dataset.plansDrawn = String(state.drawn);
        document.body.dataset.planBudget = String(answer.budget_bytes);
      });
    }
    // the best alternative without a plan (plain bf16, checkpointing, torch.compile; docs/formats.md), and how
    // much faster the plan is: its tokens/s over the alternative's
    function drawAlternative(a, p) {
      var alt = document.getElementById("plan-alternative");
      alt.textContent = "";
      if (a === null || a === undefined) return;
      alt.appendChild(el("h3", "Best alternative at this budget"));
      if (typeof a !== "object" || Array.isArray(a)) { alt.appendChild(el("p", String(a))); return; }
      var pred = a.predicted || {}, meas = a.measured || {};
      var speedup = function (x) { return typeof x === "number" && isFinite(x) ? "× " + x.toFixed(2) : "–"; };
      var cols = [["alternative", a.name === undefined ? "–" : String(a.name)],
                  ["predicted peak", bytes(pred.peak_bytes)], ["predicted step", seconds(pred.step_seconds)],
                  ["predicted tokens/s", num(pred.tokens_per_second, 5)],
                  ["plan's speed-up (predicted)", speedup(a.speedup_predicted)]];
      if (typeof meas.tokens_per_second === "number" || typeof a.speedup_measured === "number") {
        cols.push(["measured tokens/s", num(meas.tokens_per_second, 5)],
                  ["plan's speed-up (measured)", speedup(a.speedup_measured)]);
      }
      alt.appendChild(table(cols.map(function (c) { return c[0]; }), cols.map(function (c) { return c[1]; })));
      alt.appendChild(el("p", "speed-up = the plan's tokens/s (" + num(p.tokens_per_second, 5) + " predicted) ÷ " +
                         "this alternative's, both training the same tokens per step: above 1 the plan is faster, " +
                         "below 1 slower.", "meta"));
    }
    // the plan drawn no longer answers the budget asked for: take it away, so the page shows no stale plan
    function clearPlan() {
      state.current = null;
      result.hidden = true;
      ["plan-figures", "plan-alternative"].forEach(function (id) { document.getElementById(id).textContent = ""; });
      ["plan-bits", "plan-memory"].forEach(function (id) { Plotly.purge(id); });
      delete document.body.dataset.planBudget;
    }
    function suggestedName(b) {
      var base = (profile === "." ? "profile" : profile).replace(/[^A-Za-z0-9._-]+/g, "-").replace(/^[^A-Za-z0-9]+/, "");
      return (base || "profile") + "-" + b + "B.json";
    }

    function solve() {
      var seq = ++state.seq;
      if (state.controller) state.controller.abort();
      var controller = typeof AbortController === "function" ? new AbortController() : null;
      state.controller = controller;
      say("solving the plan at " + bytes(budget()) + "…", "info");
      post("/api/plan", request(), controller ? controller.signal : undefined).then(function (r) {
        if (seq !== state.seq) return;
        if (r.status === 200) {
          say("");
          return draw(r.body);
        }
        if (r.status === 503) {
          say(detailText(r.body, r.status), "info");
          setTimeout(function () { if (seq === state.seq) solve(); }, 1000 * Math.max(1, r.retry));
          return;
        }
        clearPlan();
        say(detailText(r.body, r.status), "error");
        var least = r.status === 422 && r.body && r.body.detail && r.body.detail.smallest_budget_bytes;
        if (least && least > budget() && least <= state.high) offerSmallest(least);
      }).catch(function (err) {
        if (err && err.name === "AbortError") return;
        if (seq !== state.seq) return;
        clearPlan();
        say("cannot reach the dashboard: " + err, "error");
      });
    }
    // below the smallest budget a plan fits (the range's low end ignores the error cap): a button that moves the
    // slider to the first position at or above it
    function offerSmallest(least) {
      var texts = bytesApart(budget(), least);
      budgetText.textContent = texts[0];
      var button = el("button", "move to " + texts[1]);
      button.type = "button";
      button.id = "plan-smallest";
      button.addEventListener("click", function () {
        state.pinned = null;
        slider.value = String(Math.min(STEPS, Math.ceil((least - state.low) * STEPS / (state.high - state.low))));
        moved();
      });
      status.appendChild(document.createTextNode(" "));
      status.appendChild(button);
    }
    function slid() {
      state.pinned = null;
      moved();
    }
    function moved() {
      budgetText.textContent = bytes(budget());
      clearTimeout(state.timer);
      state.timer = setTimeout(solve, DEBOUNCE_MS);
    }

    function save(overwrite) {
      var body = request();
      body.name = nameInput.value;
      body.overwrite = overwrite;
      saved.textContent = "saving…";
      post("/api/plan/save", body).then(function (r) {
        if (r.status === 409 && !overwrite) {
          saved.textContent = "";
          if (window.confirm(detailText(r.body, r.status) + "\nReplace it?")) save(true);
          return;
        }
        if (r.status !== 200) {
          saved.textContent = "not saved: " + detailText(r.body, r.status);
          saved.className = "bad";
          return;
        }
        saved.className = "";
        saved.textContent = "saved ";
        var a = el("a", r.body.id);
        a.href = "/plan?id=" + encodeURIComponent(r.body.id);
        saved.appendChild(a);
        document.body.dataset.planSaved = r.body.id;
      }).catch(function (err) { saved.textContent = "not saved: " + err; });
    }

    function range() {
      fetch("/api/plan/range?profile=" + encodeURIComponent(profile), {credentials: "same-origin"})
        .then(function (r) { return r.json().then(function (j) { return {status: r.status, body: j,
          retry: Number(r.headers.get("retry-after") || 0)}; }); })
        .then(function (r) {
          if (r.status === 503) { setTimeout(range, 1000 * Math.max(1, r.retry)); return; }
          if (r.status !== 200) { say(detailText(r.body, r.status), "error"); return; }
          if (r.body.error) { say("no plan for this profile: " + r.body.error, "empty"); return; }
          state.low = r.body.smallest_budget_bytes;
          state.high = r.body.largest_budget_bytes;
          var defaults = r.body.defaults || {};
          var chosen = start.objective || defaults.objective;
          (defaults.objectives || []).forEach(function (o) {
            var opt = el("option", o + (o === defaults.objective ? " (default)" : ""));
            opt.value = o;
            opt.selected = o === chosen;
            objective.appendChild(opt);
          });
          layout.value = start.layout || "any";
          gradients.value = start.gradients || "any";
          var b = start.budget_bytes;
          if (typeof b === "number" && isFinite(b) && b > 0) {
            var span = state.high - state.low;
            var at = span > 0 ? Math.round((b - state.low) * STEPS / span) : STEPS;
            slider.value = String(Math.max(0, Math.min(STEPS, at)));
            state.pinned = Math.round(b);
          }
          [slider, objective, layout, gradients].forEach(function (c) { c.disabled = false; });
          slider.addEventListener("input", slid);
          [objective, layout, gradients].forEach(function (c) { c.addEventListener("change", moved); });
          saveButton.addEventListener("click", function () { save(false); });
          nameInput.addEventListener("input", function () { nameInput.dataset.edited = "1"; });
          document.body.dataset.plannerReady = "1";
          moved();
        })
        .catch(function (err) { say("cannot read the budget range: " + err, "error"); });
    }
    range();
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
