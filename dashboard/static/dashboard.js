// Draws every <div class="plot" data-figure="ID"> from the JSON figure in <script id="ID">, then marks
// the page with data-plots-drawn="N" (and data-plot-errors when a figure could not be drawn).
(function () {
  "use strict";
  function draw() {
    var divs = document.querySelectorAll("div.plot");
    var jobs = [];
    var failed = 0;
    divs.forEach(function (div) {
      var spec = document.getElementById(div.dataset.figure);
      try {
        if (typeof Plotly === "undefined") throw new Error("the Plotly bundle did not load");
        var fig = JSON.parse(spec.textContent);
        jobs.push(Plotly.newPlot(div, fig.data, fig.layout, {responsive: true, displaylogo: false}));
      } catch (err) {
        failed += 1;
        div.className += " msg error";
        div.textContent = "cannot draw this chart: " + err.message;
      }
    });
    Promise.all(jobs).then(function () {
      document.body.dataset.plotsDrawn = String(jobs.length);
      document.body.dataset.plotErrors = String(failed);
    });
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", draw);
  else draw();
})();
