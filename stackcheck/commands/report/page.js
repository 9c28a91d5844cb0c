// The grid's filters: library and version pick sets, architecture, family and lane pick rows and columns, and the
// verdict boxes mute the squares of other verdicts. Every element that belongs to a square carries its data-set,
// data-lane, data-family, data-arch and data-verdict, so one predicate filters the grid, the changes and the tests.
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("report-data").textContent);
  const $ = (id) => document.getElementById(id);
  const grid = $("verdict-grid");
  if (!grid) return;  // a page of history or bench alone
  const library = $("f-library"), version = $("f-version"), arch = $("f-arch"), family = $("f-family"), lane = $("f-lane");
  const boxes = Array.from(document.querySelectorAll("#f-verdicts input"));

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
    grid.querySelectorAll("thead th.col").forEach((th) => th.classList.toggle("hidden", !placed(th)));
    grid.querySelectorAll("tbody tr.row").forEach((tr) => {
      const rowShown = placed(tr);
      let matches = 0;
      tr.querySelectorAll("td.cell, td.empty").forEach((td) => {
        const shown = rowShown && placed(td);
        td.classList.toggle("hidden", !shown);
        if (!td.classList.contains("cell")) return;
        const match = shown && verdicts.has(td.dataset.verdict);
        td.classList.toggle("muted", shown && !match);
        if (match) { matches += 1; squares += 1; cells += Number(td.dataset.count); }
      });
      tr.classList.toggle("hidden", !rowShown || matches === 0);
    });
    document.querySelectorAll(".square").forEach((div) => div.classList.toggle("hidden", !(placed(div) && verdicts.has(div.dataset.verdict))));
    document.querySelectorAll("li.change").forEach((li) => li.classList.toggle("hidden", !placed(li)));
    document.querySelectorAll("table.sets tbody tr").forEach((tr) => tr.classList.toggle("hidden", !placed(tr)));
    $("shown-squares").textContent = squares;
    $("shown-cells").textContent = cells;
  }

  library.addEventListener("change", () => { fillVersions(); apply(); });
  [version, arch, family, lane, ...boxes].forEach((el) => el.addEventListener("change", apply));
  $("f-reset").addEventListener("click", () => {
    [library, arch, family, lane].forEach((s) => { s.value = ""; });
    fillVersions();
    boxes.forEach((b) => { b.checked = true; });
    apply();
  });
  // A link to a square the filters hide shows it again: the filters are reset rather than the link dead.
  window.addEventListener("hashchange", () => {
    const target = document.getElementById(decodeURIComponent(location.hash.slice(1)));
    if (target && target.closest(".hidden")) { $("f-reset").click(); target.scrollIntoView(); }
  });
  fillVersions();
  apply();
})();
