// Live updates for the Intermission console: the server says (server-sent events, /events) that something
// changed in the person's scopes, and each live part of the page ([data-live-src]) is read again and merged
// into the page item by item ([data-key], [data-version]), so that an item being read, focused or typed
// into is never swapped away under the person. Every page works without this script.
(function () {
  "use strict";
  var regions = document.querySelectorAll("[data-live-src]");
  if (!regions.length || !window.EventSource || !window.DOMParser || !window.fetch) {
    return;
  }
  var status = document.getElementById("live-status");

  // A field the person has typed into stays theirs until they send it.
  document.addEventListener("input", function (event) {
    if (event.target && event.target.dataset) {
      event.target.dataset.dirty = "1";
    }
  });

  function say(text) {
    if (status && status.textContent !== text) {
      status.textContent = text;
    }
  }

  function busy(element) {
    return element.contains(document.activeElement) || element.querySelector("[data-dirty]") !== null;
  }

  function merge(current, fresh) {
    // Items by key; the ones the fresh list no longer has go, unless the person is in them.
    var kept = {};
    Array.prototype.forEach.call(current.children, function (child) {
      if (child.dataset.key) {
        kept[child.dataset.key] = child;
      }
    });
    var wanted = {};
    Array.prototype.forEach.call(fresh.children, function (child) {
      if (child.dataset.key) {
        wanted[child.dataset.key] = true;
      }
    });
    Object.keys(kept).forEach(function (key) {
      if (!wanted[key] && !busy(kept[key])) {
        kept[key].remove();
        delete kept[key];
      }
    });
    var cursor = current.firstElementChild;
    Array.prototype.forEach.call(fresh.children, function (child) {
      var old = child.dataset.key ? kept[child.dataset.key] : null;
      if (old) {
        if (old.dataset.version !== child.dataset.version && !busy(old)) {
          var replaced = document.importNode(child, true);
          old.replaceWith(replaced);
          old = replaced;
        }
        cursor = old.nextElementSibling;
        return;
      }
      var added = document.importNode(child, true);
      added.classList.add("arrived");
      current.insertBefore(added, cursor);
    });
  }

  function apply(region, html) {
    var parsed = new DOMParser().parseFromString(html, "text/html");
    var fresh = parsed.getElementById(region.id);
    if (!fresh) {
      return;
    }
    var currentLists = region.querySelectorAll("[data-live-list]");
    var freshLists = fresh.querySelectorAll("[data-live-list]");
    var same = currentLists.length === freshLists.length;
    Array.prototype.forEach.call(freshLists, function (list, i) {
      same = same && currentLists[i] && currentLists[i].id === list.id;
    });
    if (!same) {
      // The shape changed (a first item, or the last one gone): take the fresh part whole, unless the
      // person is in it, in which case the next change brings it.
      if (!busy(region)) {
        region.replaceWith(document.importNode(fresh, true));
      }
      return;
    }
    Array.prototype.forEach.call(freshLists, function (list, i) {
      merge(currentLists[i], list);
    });
    Array.prototype.forEach.call(fresh.querySelectorAll("[data-live-text]"), function (text) {
      var mine = document.getElementById(text.id);
      if (mine && mine.textContent !== text.textContent) {
        mine.textContent = text.textContent;
      }
    });
  }

  var pending = null;
  function refresh() {
    pending = null;
    Array.prototype.forEach.call(document.querySelectorAll("[data-live-src]"), function (region) {
      fetch(region.dataset.liveSrc, { credentials: "same-origin", headers: { Accept: "text/html" } })
        .then(function (response) {
          if (response.redirected || !response.ok) {
            throw new Error("not signed in");
          }
          return response.text();
        })
        .then(function (html) {
          apply(region, html);
          say("Updated " + new Date().toLocaleTimeString() + ".");
        })
        .catch(function () {
          say("Live updates stopped: reload the page.");
        });
    });
  }

  var source = new EventSource("/events");
  source.addEventListener("open", function () {
    say("Live: this page updates by itself.");
  });
  source.addEventListener("changed", function (event) {
    var change = {};
    try {
      change = JSON.parse(event.data);
    } catch (ignored) {
      change = {};
    }
    var run = document.querySelector("[data-run-id]");
    if (run && change.run_id && run.dataset.runId !== change.run_id && regions.length === 1) {
      return; // another run than the one this page shows
    }
    if (pending === null) {
      pending = window.setTimeout(refresh, 150);
    }
  });
  source.addEventListener("ended", function () {
    source.close();
    say("Your session ended: log in again.");
  });
  source.addEventListener("error", function () {
    if (source.readyState === EventSource.CLOSED) {
      say("Live updates stopped: reload the page.");
    } else {
      say("Reconnecting live updates…");
    }
  });
})();
