// trajstore UI: the run dashboard's charts (Chart.js, vendored) and the token inspector.
(function () {
  "use strict";
  var palette = ["#3056d3", "#d9480f", "#2f9e44", "#ae3ec9", "#f59f00", "#1098ad",
                 "#e64980", "#5c940d", "#868e96", "#364fc7"];

  function stacked(id, versions, series) {
    var el = document.getElementById(id);
    if (!el) return;
    new Chart(el, {
      type: "bar",
      data: { labels: versions.map(function (v) { return "v" + v; }),
              datasets: series.map(function (s, i) {
                return { label: s.label, data: s.data, backgroundColor: palette[i % palette.length] };
              }) },
      options: { animation: false, maintainAspectRatio: false,
                 scales: { x: { stacked: true, title: { display: true, text: "policy version" } },
                           y: { stacked: true, beginAtZero: true, ticks: { precision: 0 } } } }
    });
  }

  function lines(id, versions, sets, yMax) {
    var el = document.getElementById(id);
    if (!el) return;
    new Chart(el, {
      type: "line",
      data: { labels: versions.map(function (v) { return "v" + v; }),
              datasets: sets.map(function (s, i) {
                return { label: s.label, data: s.data, borderColor: palette[i % palette.length],
                         backgroundColor: palette[i % palette.length], spanGaps: true, tension: 0.2 };
              }) },
      options: { animation: false, maintainAspectRatio: false,
                 scales: { x: { title: { display: true, text: "policy version" } },
                           y: { beginAtZero: true, suggestedMax: yMax } } }
    });
  }

  var data = document.getElementById("chart-data");
  if (data && window.Chart) {
    var c = JSON.parse(data.textContent);
    stacked("chart-error-types", c.versions, c.failures_by_error_type);
    stacked("chart-tools", c.versions, c.failures_by_tool);
    lines("chart-reward", c.versions, [{ label: "mean reward", data: c.reward }]);
    lines("chart-recovery", c.versions, [
      { label: "rollback recovery rate", data: c.recovery_rate },
      { label: "tool error rate", data: c.tool_error_rate }], 1);
    document.body.dataset.charts = "ready";
  }

  var inspector = document.getElementById("inspector");
  if (inspector) {
    document.addEventListener("mouseover", function (ev) {
      var t = ev.target.closest ? ev.target.closest(".t[data-id]") : null;
      if (!t) return;
      var trained = t.classList.contains("m1");
      inspector.hidden = false;
      inspector.textContent = "token #" + t.dataset.i + "  id " + t.dataset.id + "  " +
        JSON.stringify(t.textContent) + "\n" +
        (trained ? "trained · logprob " + t.dataset.lp : "context · not trained");
      inspector.style.whiteSpace = "pre";
    });
  }
})();
