// agent-inbox console: live updates, no dependencies, served by the console.
// - [data-live] sections poll their JSON endpoint every 5 s and fill [data-field]s;
// - .countdown elements count down to their data-until (epoch seconds), on the
//   server's clock (body data-now at render time).
"use strict";
(function () {
  var serverNow = parseInt(document.body.dataset.now || "", 10);
  var skew = isNaN(serverNow) ? 0 : serverNow - Date.now() / 1000;

  function duration(seconds) {
    var units = [["d", 86400], ["h", 3600], ["m", 60], ["s", 1]], parts = [];
    for (var i = 0; i < units.length && parts.length < 2; i++) {
      var size = units[i][1];
      if (seconds >= size || (units[i][0] === "s" && parts.length === 0)) {
        parts.push(Math.floor(seconds / size) + units[i][0]);
        seconds %= size;
      }
    }
    return parts.join(" ");
  }

  function relative(seconds) {
    if (seconds === 0) return "now";
    return seconds > 0 ? "in " + duration(seconds) : duration(-seconds) + " ago";
  }

  function tick() {
    var now = Math.floor(Date.now() / 1000 + skew);
    document.querySelectorAll(".countdown[data-until]").forEach(function (el) {
      el.textContent = relative(parseInt(el.dataset.until, 10) - now);
    });
  }

  function lookup(data, path) {
    return path.split(".").reduce(function (v, k) { return v == null ? v : v[k]; }, data);
  }

  function poll(section) {
    fetch(section.dataset.live, {credentials: "same-origin", headers: {"Accept": "application/json"}})
      .then(function (r) { if (!r.ok) throw new Error(r.status); return r.json(); })
      .then(function (data) {
        skew = data.now - Date.now() / 1000;
        document.querySelectorAll("[data-field]").forEach(function (el) {
          var value = lookup(data, el.dataset.field);
          if (el.dataset.format === "age") value = value == null ? "-" : duration(value);
          el.textContent = value == null ? "-" : String(value);
        });
        var chart = document.getElementById("chart");
        if (chart) chart.src = "/overview/chart.svg?at=" + data.now;
        var updated = document.getElementById("updated");
        if (updated) updated.textContent = "Last update: " + new Date().toLocaleTimeString();
      })
      .catch(function (e) {
        var updated = document.getElementById("updated");
        if (updated) updated.textContent = "Update failed (" + e.message + "); retrying.";
      });
  }

  tick();
  setInterval(tick, 1000);
  document.querySelectorAll("[data-live]").forEach(function (section) {
    setInterval(function () { poll(section); }, 5000);
  });
})();
