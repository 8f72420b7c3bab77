// The lmsp playground: a client of the public API, as any program is.
//
// A prompt becomes a background task (POST /lmsp/v1/tasks); its answer is
// followed through a signed stream URL (POST .../stream-url), which the
// browser's EventSource can open without an Authorization header. The
// conversation and the answer in progress (its task id and the id of the last
// event shown) are written to localStorage with every event, so that a
// reload, a tab closed and reopened or a lost network goes on from the next
// event: nothing repeated, nothing missing. The token stays in the tab's
// sessionStorage.
"use strict";

(() => {
  const API = "/lmsp/v1";
  const TOKEN_KEY = "lmsp.playground.token";
  const STATE_KEY = "lmsp.playground.state";
  const FINAL = ["response.completed", "response.incomplete", "response.failed", "response.cancelled"];
  const EVENTS = [
    "response.created",
    "response.output_item.added",
    "response.output_text.delta",
    "response.output_item.done",
    ...FINAL,
  ];
  const FINAL_STATUSES = ["completed", "incomplete", "failed", "cancelled"];
  const $ = (id) => document.getElementById(id);
  // The settings kept with the conversation: field id -> state key.
  const SETTINGS = { system: "system", temperature: "temperature", "max-tokens": "maxTokens", schema: "schema" };

  let state = load();
  let source = null; // the EventSource of the answer in progress
  let retry = null; // the timer of the next try to follow it
  let failures = 0; // tries in a row that did not get a stream

  class Problem extends Error {
    constructor(doc, status) {
      super(doc.detail || doc.code);
      this.doc = doc;
      this.status = status;
    }
  }

  function fresh() {
    return { turns: [], previousResponseId: null, pending: null, usage: null, budget: null, model: null };
  }

  function load() {
    try {
      return { ...fresh(), ...JSON.parse(localStorage.getItem(STATE_KEY) || "{}") };
    } catch {
      return fresh();
    }
  }

  function save() {
    localStorage.setItem(STATE_KEY, JSON.stringify(state));
  }

  function token() {
    return sessionStorage.getItem(TOKEN_KEY);
  }

  async function api(method, path, body) {
    const headers = { Authorization: `Bearer ${token()}` };
    if (body !== undefined) headers["Content-Type"] = "application/json";
    let answer;
    try {
      answer = await fetch(API + path, {
        method,
        headers,
        body: body === undefined ? undefined : JSON.stringify(body),
      });
    } catch {
      throw new Problem({ code: "network", detail: "" }, 0);
    }
    let data = null;
    try {
      data = await answer.json();
    } catch {
      data = null;
    }
    if (!answer.ok) {
      throw new Problem(data && data.code ? data : { code: "http", detail: "" }, answer.status);
    }
    return { data, headers: answer.headers };
  }

  // A problem document as sentences a person reads.
  function sentence(doc) {
    const detail = doc.detail ? ` ${doc.detail}` : "";
    switch (doc.code) {
      case "network":
        return "The service could not be reached; check the network. The answer goes on when it is back.";
      case "rate_limited":
        if (doc.quota) return `Your token budget is used up.${detail}`;
        return `Too many requests at once for your account; try again shortly.${detail}`;
      case "model_not_found":
        return `This model does not exist, or your account may not use it.${detail}`;
      case "response_not_found":
        if ((doc.param || "").endsWith("previous_response_id")) {
          return "The earlier turns of this conversation are no longer stored; start a new conversation.";
        }
        return `That response is no longer stored.${detail}`;
      case "task_not_found":
        return "The answer in progress is no longer available: it was erased, or it belongs to another account.";
      case "event_history_expired":
        return "The events of this answer were removed by retention; its stored text is shown instead.";
      case "unauthorized":
        return `The token was refused; sign in again.${detail}`;
      case "insufficient_scope":
        return `This token may not do that.${detail}`;
      case "overloaded":
        return `The service is busy; try again in a few seconds.${detail}`;
      case "context_length_exceeded":
        return `The conversation has grown too long for this model; start a new conversation.${detail}`;
      case "invalid_request":
        return `The request was refused.${detail}`;
      case "task_not_cancellable":
        return "The answer had already ended.";
      default:
        return doc.detail || "Something went wrong; try again.";
    }
  }

  function showError(text) {
    const box = $("error");
    box.textContent = text || "";
    box.hidden = !text;
  }

  function setStatus(text) {
    $("status").textContent = text;
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
  }

  // --- what the page shows ---------------------------------------------------------

  function turnElement(turn) {
    const item = document.createElement("li");
    item.className = `turn ${turn.role}`;
    const role = document.createElement("div");
    role.className = "role";
    role.textContent = turn.role === "user" ? "You" : "Assistant";
    const text = document.createElement("div");
    text.className = "text";
    item.append(role, text);
    fillTurn(item, turn);
    return item;
  }

  function fillTurn(item, turn) {
    item.querySelector(".text").textContent = turn.text;
    if (turn.responseId) item.dataset.responseId = turn.responseId;
    if (turn.taskId) item.dataset.taskId = turn.taskId;
    if (turn.status) item.dataset.status = turn.status;
  }

  function render() {
    for (const [field, key] of Object.entries(SETTINGS)) {
      if (state[key] !== undefined) $(field).value = state[key];
    }
    $("conversation").replaceChildren(...state.turns.map(turnElement));
    showUsage();
    $("budget").textContent = state.budget || "Not known yet.";
  }

  function updateLastTurn() {
    const items = $("conversation").children;
    if (items.length) fillTurn(items[items.length - 1], state.turns[state.turns.length - 1]);
  }

  function showUsage() {
    const usage = state.usage;
    $("usage").textContent = usage
      ? `Last answer: ${usage.input_tokens} input and ${usage.output_tokens} output tokens.`
      : "None yet.";
  }

  // "output-tokens-day=49984, input-tokens-month=8766" as a sentence
  function budgetText(header) {
    if (!header) return "No token budget is set for your account.";
    const parts = header.split(",").map((entry) => {
      const [name, value] = entry.trim().split("=");
      const [kind, , period] = name.split("-");
      const when = period === "day" ? "today (UTC)" : "this month (UTC)";
      return `${Number(value).toLocaleString("en")} ${kind} tokens ${when}`;
    });
    return `${parts.join("; ")}.`;
  }

  // --- signing in --------------------------------------------------------------------

  async function signIn(secret) {
    sessionStorage.setItem(TOKEN_KEY, secret);
    let models;
    try {
      models = (await api("GET", "/models")).data.data;
    } catch (problem) {
      sessionStorage.removeItem(TOKEN_KEY);
      showError(sentence(problem.doc));
      return;
    }
    showError("");
    const select = $("model");
    select.replaceChildren(
      ...models.map((model) => {
        const option = document.createElement("option");
        option.value = option.textContent = model.id;
        return option;
      }),
    );
    if (state.model && models.some((model) => model.id === state.model)) select.value = state.model;
    $("who").textContent = models.length
      ? `Signed in. ${models.length === 1 ? "One model is" : `${models.length} models are`} open to you.`
      : "Signed in, but no model is open to your account.";
    $("signin").hidden = true;
    $("workspace").hidden = false;
    render();
    setBusy(Boolean(state.pending));
    if (state.pending) follow();
  }

  function signOut() {
    stopFollowing();
    sessionStorage.removeItem(TOKEN_KEY);
    state = fresh();
    save();
    $("workspace").hidden = true;
    $("signin").hidden = false;
    $("token").value = "";
  }

  async function sessionSignIn(button) {
    const csrf = document.querySelector("meta[name=csrf-token]").content;
    try {
      const answer = await fetch(button.dataset.url, { method: "POST", headers: { "X-CSRFToken": csrf } });
      const data = await answer.json();
      if (!answer.ok) throw new Problem(data, answer.status);
      await signIn(data.token);
    } catch (problem) {
      showError(problem instanceof Problem ? sentence(problem.doc) : "The admin session could not sign in.");
    }
  }

  // --- sending and following ---------------------------------------------------------

  function requestBody(text) {
    const input = [];
    const system = $("system").value.trim();
    if (system && !state.previousResponseId) {
      input.push({ type: "message", role: "system", content: [{ type: "input_text", text: system }] });
    }
    input.push({ type: "message", role: "user", content: [{ type: "input_text", text }] });
    const request = {
      model: $("model").value,
      input,
      temperature: Number($("temperature").value),
      max_output_tokens: Number($("max-tokens").value),
      store: true,
    };
    if (state.previousResponseId) request.previous_response_id = state.previousResponseId;
    const schema = $("schema").value.trim();
    if (schema) {
      request.response_format = { type: "json_schema", json_schema: { name: "answer", schema: JSON.parse(schema) } };
    }
    return request;
  }

  async function send(text) {
    let request;
    try {
      request = requestBody(text);
    } catch {
      showError("The JSON schema is not valid JSON.");
      return;
    }
    showError("");
    setBusy(true);
    setStatus("Sending…");
    let answer;
    try {
      answer = await api("POST", "/tasks", { type: "response", request });
    } catch (problem) {
      setBusy(false);
      setStatus("");
      showError(sentence(problem.doc));
      return;
    }
    const task = answer.data;
    state.model = request.model;
    for (const [field, key] of Object.entries(SETTINGS)) state[key] = $(field).value;
    state.budget = budgetText(answer.headers.get("LMSP-Budget-Remaining"));
    state.turns.push(
      { role: "user", text },
      { role: "assistant", text: "", taskId: task.id, responseId: task.response_id, status: "in_progress" },
    );
    state.pending = { taskId: task.id, lastEventId: 0 };
    save();
    $("prompt").value = "";
    render();
    window.scrollTo(0, document.body.scrollHeight);
    follow();
  }

  function stopFollowing() {
    clearTimeout(retry);
    if (source) source.close();
    source = null;
  }

  function followAgain() {
    stopFollowing();
    failures += 1;
    retry = setTimeout(follow, Math.min(500 * 2 ** failures, 10_000));
  }

  // The answer in progress, from the event after the last one shown.
  async function follow() {
    stopFollowing();
    const pending = state.pending;
    if (!pending) return;
    setBusy(true);
    let task;
    let url;
    try {
      task = (await api("GET", `/tasks/${pending.taskId}`)).data;
      if (FINAL_STATUSES.includes(task.status) && task.last_event_id <= pending.lastEventId) {
        finishFrom(task);
        return;
      }
      url = (await api("POST", `/tasks/${pending.taskId}/stream-url`)).data.url;
    } catch (problem) {
      if (problem.status === 0 || problem.status >= 500) {
        setStatus(sentence(problem.doc));
        followAgain();
        return;
      }
      abandon(sentence(problem.doc));
      return;
    }
    if (pending.lastEventId) url += `&after=${pending.lastEventId}`;
    setStatus(pending.lastEventId ? "Continuing the answer…" : "Waiting for the model…");
    const events = new EventSource(url);
    source = events;
    for (const name of EVENTS) events.addEventListener(name, (event) => onEvent(events, name, event));
    events.addEventListener("open", () => {
      failures = 0;
    });
    events.addEventListener("error", () => {
      if (events !== source) return;
      if (events.readyState === EventSource.CLOSED) {
        followAgain(); // refused (the URL expired, the task is gone...): ask again
      } else {
        setStatus("The connection was lost; reconnecting…");
      }
    });
  }

  function currentTurn() {
    return state.turns[state.turns.length - 1];
  }

  function onEvent(events, name, event) {
    const pending = state.pending;
    if (events !== source || !pending) return;
    const id = Number(event.lastEventId);
    if (id <= pending.lastEventId) return; // shown before this reconnect
    const data = JSON.parse(event.data);
    const turn = currentTurn();
    if (name === "response.output_text.delta") {
      turn.text += data.delta;
      setStatus("Generating…");
    }
    pending.lastEventId = id;
    if (FINAL.includes(name)) {
      finish(turn, data.status, data.usage, data.error);
    } else {
      save(); // the text and the id it reaches, in one write
      updateLastTurn();
    }
  }

  function finish(turn, status, usage, error) {
    stopFollowing();
    failures = 0;
    turn.status = status;
    if (usage) state.usage = usage;
    if (status === "completed" || status === "incomplete") state.previousResponseId = turn.responseId;
    state.pending = null;
    save();
    updateLastTurn();
    showUsage();
    setBusy(false);
    const endings = {
      completed: "",
      incomplete: "The answer stopped at the output token limit.",
      cancelled: "The answer was stopped.",
      failed: "",
    };
    setStatus(endings[status] || "");
    if (status === "failed") showError(sentence(error || {}));
  }

  // The task ended while nobody followed it: its stored result, when the page
  // missed some of its events.
  function finishFrom(task) {
    const turn = currentTurn();
    const result = task.result || {};
    if (task.last_event_id > state.pending.lastEventId) turn.text = outputText(result);
    finish(turn, task.status, result.usage, task.error || result.error);
  }

  function outputText(response) {
    return (response.output || [])
      .filter((item) => item.type === "message")
      .flatMap((item) => item.content || [])
      .filter((part) => part.type === "output_text")
      .map((part) => part.text)
      .join("");
  }

  function abandon(text) {
    stopFollowing();
    const turn = currentTurn();
    if (turn && turn.status === "in_progress") turn.status = "failed";
    state.pending = null;
    save();
    render();
    setBusy(false);
    setStatus("");
    showError(text);
  }

  async function stop() {
    const pending = state.pending;
    if (!pending) return;
    $("stop").disabled = true;
    try {
      await api("POST", `/tasks/${pending.taskId}/cancel`);
      setStatus("Stopping…");
    } catch (problem) {
      if (problem.doc.code !== "task_not_cancellable") showError(sentence(problem.doc));
    }
  }

  function newConversation() {
    stopFollowing();
    const kept = Object.fromEntries(Object.values(SETTINGS).map((key) => [key, state[key]]));
    state = { ...fresh(), ...kept, budget: state.budget, model: $("model").value };
    save();
    render();
    setBusy(false);
    setStatus("");
    showError("");
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("token-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const secret = $("token").value.trim();
      if (secret) signIn(secret);
    });
    const session = $("session-sign-in");
    if (session) session.addEventListener("click", () => sessionSignIn(session));
    $("composer").addEventListener("submit", (event) => {
      event.preventDefault();
      const text = $("prompt").value.trim();
      if (text && !state.pending) send(text);
    });
    $("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) $("composer").requestSubmit();
    });
    $("stop").addEventListener("click", stop);
    $("new-conversation").addEventListener("click", newConversation);
    $("sign-out").addEventListener("click", signOut);
    $("model").addEventListener("change", () => {
      state.model = $("model").value;
      save();
    });
    for (const [field, key] of Object.entries(SETTINGS)) {
      $(field).addEventListener("change", () => {
        state[key] = $(field).value;
        save();
      });
    }
    window.addEventListener("online", () => {
      if (state.pending) follow();
    });
    if (token()) signIn(token());
  });
})();
