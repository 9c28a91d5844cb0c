// The grid's filters: library and version pick sets, architecture, family and lane pick cells, rows and columns, and
// the verdict boxes mute the cells of other verdicts. Every element that belongs to a cell carries its data-set,
// data-lane, data-family, data-arch and data-verdict, so one predicate filters the grid, the changes and the tests.
// The filters live in the URL's query (?arch=llama3&verdicts=error,new_failure): a view can be shared, a reload keeps
// it, and back and forward step through the filters chosen.
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("report-data").textContent);
  const $ = (id) => document.getElementById(id);
  const grid = $("verdict-grid");
  if (!grid) return;  // a page of history or bench alone
  const selects = { library: $("f-library"), version: $("f-version"), arch: $("f-arch"), family: $("f-family"), lane: $("f-lane") };
  const { library, version, arch, family, lane } = selects;
  const boxes = Array.from(document.querySelectorAll("#f-verdicts input"));
  const hide = (el, hidden) => el.classList.toggle("hidden", hidden);

  function fillVersions() {
    const chosen = library.value;
    version.innerHTML = '<option value="">any</option>';
    (data.choices[chosen] || []).forEach((v) => {
      const option = document.createElement("option");
      option.value = option.textContent = v;
      version.appendChild(option);
    });
    version.disabled = !chosen;
  }

  function setShown(name) {
    if (!library.value || !version.value) return true;
    return (data.versions[name] || {})[library.value] === version.value;
  }

  // Whether an element's set, lane, family and architecture pass the filters (an attribute it lacks passes).
  function placed(el) {
    const d = el.dataset;
    if (d.set !== undefined && !setShown(d.set)) return false;
    if (lane.value && d.lane !== undefined && d.lane !== lane.value) return false;
    if (family.value && d.family !== undefined && d.family !== family.value) return false;
    if (arch.value && d.arch !== undefined && d.arch !== arch.value) return false;
    return true;
  }

  function apply() {
    const verdicts = new Set(boxes.filter((b) => b.checked).map((b) => b.value));
    let squares = 0, cells = 0;
    grid.querySelectorAll("thead th.col, thead th.strip, thead th.strip span, td.strip").forEach((el) => hide(el, !placed(el)));
    grid.querySelectorAll("tbody tr.row").forEach((tr) => {
      const rowShown = placed(tr);
      let matches = 0;
      tr.querySelectorAll(".cell, .empty").forEach((el) => {
        const shown = rowShown && placed(el);
        hide(el, !shown);
        if (!el.classList.contains("cell")) return;
        const match = shown && verdicts.has(el.dataset.verdict);
        el.classList.toggle("muted", shown && !match);
        if (match) { matches += 1; squares += 1; cells += Number(el.dataset.count); }
      });
      hide(tr, !rowShown || matches === 0);
    });
    document.querySelectorAll(".square").forEach((div) => hide(div, !(placed(div) && verdicts.has(div.dataset.verdict))));
    document.querySelectorAll("li.change").forEach((li) => {
      const archs = Array.from(li.querySelectorAll("a[data-arch]"));
      archs.forEach((a) => hide(a, !placed(a)));
      const onLane = !lane.value || li.dataset.lanes.split(" ").includes(lane.value);
      hide(li, !placed(li) || !onLane || archs.every((a) => a.classList.contains("hidden")));
    });
    document.querySelectorAll("table.sets tbody tr").forEach((tr) => hide(tr, !placed(tr)));
    $("shown-squares").textContent = squares;
    $("shown-cells").textContent = cells;
  }

  // The filters as a query string ("" when nothing is filtered), and back from one.
  function query() {
    const q = new URLSearchParams();
    Object.entries(selects).forEach(([key, select]) => { if (select.value) q.set(key, select.value); });
    if (boxes.some((b) => !b.checked)) q.set("verdicts", boxes.filter((b) => b.checked).map((b) => b.value).join(","));
    const text = q.toString();
    return text ? "?" + text : "";
  }

  function restore(search) {
    const q = new URLSearchParams(search);
    library.value = q.get("library") || "";
    fillVersions();
    ["version", "arch", "family", "lane"].forEach((key) => { selects[key].value = q.get(key) || ""; });
    const chosen = q.get("verdicts");
    boxes.forEach((b) => { b.checked = chosen === null || chosen.split(",").includes(b.value); });
    apply();
  }

  // A filter changed: a new history entry, so that back returns to the view before.
  function changed() {
    apply();
    if (query() !== location.search) history.pushState(null, "", location.pathname + query() + location.hash);
  }

  library.addEventListener("change", () => { fillVersions(); changed(); });
  [version, arch, family, lane, ...boxes].forEach((el) => el.addEventListener("change", changed));
  $("f-reset").addEventListener("click", () => { restore(""); changed(); });
  window.addEventListener("popstate", () => restore(location.search));
  // A link to a cell the filters hide shows it again: the filters are reset rather than the link dead.
  window.addEventListener("hashchange", () => {
    const target = document.getElementById(decodeURIComponent(location.hash.slice(1)));
    if (target && target.closest(".hidden")) {
      restore("");
      history.replaceState(null, "", location.pathname + location.hash);
      target.scrollIntoView();
    }
  });
  restore(location.search);
})();
