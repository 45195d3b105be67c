// Warren's management UI: plain JavaScript over the management API (/api), no build step.
// Every name that comes from the broker (queues, exchanges, payloads) is put in the page as text
// (textContent), never as HTML: a queue named "<img onerror=...>" shows as those characters.
'use strict';

const REFRESH_MS = 5000;
const CHART_AGE_S = 600;
const enc = encodeURIComponent;

const state = {
  auth: sessionStorage.getItem('warren-auth'), // base64 of "user:password"
  user: null,
  tags: [], // the user's, from /api/whoami: what the navigation offers
  timer: null,
  page: null, // what is shown: {refresh}
};

// ---- DOM helpers -------------------------------------------------------------------------

// h('tag', {attr: value, on: {click: fn}}, children...): children are nodes or text.
function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === 'on') {
      for (const [event, fn] of Object.entries(value)) el.addEventListener(event, fn);
    } else if (key === 'class') {
      el.className = value;
    } else if (value === true) {
      el.setAttribute(key, '');
    } else if (value !== false && value !== null && value !== undefined) {
      el.setAttribute(key, String(value));
    }
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

function clear(el) {
  while (el.firstChild) el.removeChild(el.firstChild);
  return el;
}

function flash(text, isError) {
  const el = document.getElementById('flash');
  el.textContent = text;
  el.className = isError ? 'error' : '';
  el.hidden = !text;
  if (text && !isError) setTimeout(() => { if (el.textContent === text) el.hidden = true; }, 4000);
}

const fmt = {
  num: (n) => (n === undefined || n === null ? '' : Number(n).toLocaleString('en')),
  rate: (d) => (d && typeof d.rate === 'number' ? d.rate.toFixed(1) + '/s' : ''),
  bytes: (n) => {
    if (typeof n !== 'number') return '';
    const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return n.toFixed(i ? 1 : 0) + ' ' + units[i];
  },
  uptime: (ms) => {
    const s = Math.floor((ms || 0) / 1000);
    const d = Math.floor(s / 86400), hr = Math.floor(s / 3600) % 24, m = Math.floor(s / 60) % 60;
    return (d ? d + 'd ' : '') + hr + 'h ' + m + 'm';
  },
  args: (a) => Object.entries(a || {}).map(([k, v]) => k + '=' + JSON.stringify(v)).join(', '),
};

// A table: columns are [title, row => cell (text or node), class].
function table(columns, rows, empty) {
  if (!rows.length) return h('p', { class: 'muted' }, empty || 'None.');
  return h('table', {},
    h('thead', {}, h('tr', {}, columns.map(([title]) => h('th', {}, title)))),
    h('tbody', {}, rows.map((row) => h('tr', {}, columns.map(([, cell, cls]) => h('td', { class: cls }, cell(row)))))));
}

// A button that asks to be pressed again before it acts (no modal dialog to get stuck on).
function dangerButton(label, action) {
  let armed = null;
  const button = h('button', { class: 'danger', type: 'button' }, label);
  button.addEventListener('click', async () => {
    if (!armed) {
      button.textContent = 'Really ' + label.toLowerCase() + '?';
      armed = setTimeout(() => { armed = null; button.textContent = label; }, 4000);
      return;
    }
    clearTimeout(armed);
    armed = null;
    button.textContent = label;
    await action();
  });
  return button;
}

const link = (hash, text) => h('a', { href: hash }, text);
const hasTag = (tag) => state.tags.includes(tag);
const isAdministrator = () => hasTag('administrator');
const isMonitor = () => isAdministrator() || hasTag('monitoring');
const queueHash = (q) => '#/queues/' + enc(q.vhost) + '/' + enc(q.name);
const exchangeHash = (e) => '#/exchanges/' + enc(e.vhost) + '/' + enc(e.name === '' ? 'amq.default' : e.name);

// ---- The API -----------------------------------------------------------------------------

class ApiError extends Error {
  constructor(message, status) {
    super(message);
    this.status = status;
  }
}

async function api(method, path, body, headers) {
  const response = await fetch('/api' + path, {
    method,
    headers: Object.assign({ Authorization: 'Basic ' + state.auth, 'Content-Type': 'application/json', 'X-Requested-With': 'XMLHttpRequest' }, headers || {}),
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await response.text();
  let json = null;
  try { json = text ? JSON.parse(text) : null; } catch (e) { json = null; }
  // 401 is also what the API answers a logged-in user whose tags do not reach a path ("Not
  // administrator user"), with error "not_authorised" (RabbitMQ's spelling for that case): only
  // the others ("not_authorized": the credentials) mean logging in again.
  if (response.status === 401 && !(json && json.error === 'not_authorised')) {
    logout('Your session needs logging in again.');
    throw new ApiError('not logged in', 401);
  }
  if (!response.ok) throw new ApiError((json && (json.reason || json.error)) || response.status + ' ' + response.statusText, response.status);
  return json;
}

// Runs an action from a form or button: its error is shown, a success message too.
async function act(action, success) {
  const page = location.hash;
  try {
    await action();
    if (success) flash(typeof success === 'function' ? success() : success);
    if (location.hash === page) await refresh(); // else the new page is on its way (hashchange)
  } catch (e) {
    flash(e.message, true);
  }
}

// ---- Charts ------------------------------------------------------------------------------

// Lines over time on a canvas: series are {name, color, points: [[timestamp_ms, value], ...]}.
function drawChart(canvas, series, unit) {
  const ctx = canvas.getContext('2d');
  const w = canvas.width, hgt = canvas.height, left = 60, bottom = 20, top = 10, right = 10;
  ctx.clearRect(0, 0, w, hgt);
  const all = series.flatMap((s) => s.points);
  const now = Date.now();
  const t0 = now - CHART_AGE_S * 1000;
  const max = Math.max(1, ...all.map((p) => p[1]));
  const x = (t) => left + ((t - t0) / (now - t0)) * (w - left - right);
  const y = (v) => hgt - bottom - (v / max) * (hgt - bottom - top);
  ctx.strokeStyle = '#ccc';
  ctx.fillStyle = '#555';
  ctx.font = '11px sans-serif';
  ctx.beginPath();
  ctx.moveTo(left, top);
  ctx.lineTo(left, hgt - bottom);
  ctx.lineTo(w - right, hgt - bottom);
  ctx.stroke();
  ctx.fillText(max.toLocaleString('en', { maximumFractionDigits: 1 }) + unit, 2, top + 8);
  ctx.fillText('0', left - 12, hgt - bottom);
  ctx.fillText('-' + CHART_AGE_S / 60 + ' min', left, hgt - 4);
  ctx.fillText('now', w - right - 22, hgt - 4);
  for (const s of series) {
    ctx.strokeStyle = s.color;
    ctx.lineWidth = 2;
    ctx.beginPath();
    s.points.filter((p) => p[0] >= t0).forEach((p, i) => (i ? ctx.lineTo(x(p[0]), y(p[1])) : ctx.moveTo(x(p[0]), y(p[1]))));
    ctx.stroke();
  }
}

function chartPanel(title, id) {
  return h('div', { class: 'panel' }, h('h2', {}, title), h('canvas', { class: 'chart', id, width: 560, height: 180 }), h('div', { class: 'legend', id: id + '-legend' }));
}

function legend(id, series, last) {
  const swatch = (color) => { const i = h('i'); i.style.background = color; return i; }; // CSSOM: allowed by the CSP
  clear(document.getElementById(id + '-legend')).append(...series.map((s) => h('span', {}, swatch(s.color), s.name + ': ' + last(s))));
}

// Samples come newest first; counters become rates between neighbouring samples.
const levelPoints = (details) => (details && details.samples ? details.samples.map((s) => [s.timestamp, s.sample]).reverse() : []);
function ratePoints(details) {
  const s = details && details.samples ? details.samples : [];
  const out = [];
  for (let i = s.length - 1; i > 0; i--) {
    const secs = (s[i - 1].timestamp - s[i].timestamp) / 1000;
    if (secs > 0) out.push([s[i - 1].timestamp, Math.max(0, (s[i - 1].sample - s[i].sample) / secs)]);
  }
  return out;
}

// ---- Pages -------------------------------------------------------------------------------

const pages = {};

// A form publishing through an exchange: with `routingKey` fixed (a queue's page, through the
// default exchange), else with a routing key field. Says whether a queue took the message.
function publishForm(vhost, exchange, routingKey) {
  const form = h('form', { id: 'publish' },
    routingKey === null ? h('label', {}, 'Routing key ', h('input', { type: 'text', name: 'key' })) : null,
    h('label', {}, 'Payload', h('br'), h('textarea', { name: 'payload' })),
    h('label', {}, h('input', { type: 'checkbox', name: 'persistent', checked: true }), ' persistent'),
    h('button', { type: 'submit' }, 'Publish message'));
  form.addEventListener('submit', (e) => {
    e.preventDefault();
    const f = form.elements;
    act(async () => {
      const answer = await api('POST', '/exchanges/' + enc(vhost) + '/' + enc(exchange) + '/publish', {
        routing_key: routingKey === null ? f.key.value : routingKey, payload: f.payload.value, payload_encoding: 'string',
        properties: { delivery_mode: f.persistent.checked ? 2 : 1 },
      });
      if (!answer || !answer.routed) throw new ApiError('The message was published, but no queue took it.');
    }, 'Message published.');
  });
  return form;
}

pages.overview = (main) => {
  // The nodes are for monitoring and administrator users (the API refuses the others).
  const monitor = isMonitor();
  main.append(
    h('h1', {}, 'Overview'),
    h('div', { id: 'totals' }),
    chartPanel('Queued messages', 'queued-chart'),
    chartPanel('Message rates', 'rates-chart'),
    monitor ? h('h2', {}, 'Nodes') : null,
    monitor ? h('div', { id: 'nodes' }) : null);
  return async () => {
    const age = '?lengths_age=' + CHART_AGE_S + '&lengths_incr=5&msg_rates_age=' + CHART_AGE_S + '&msg_rates_incr=5';
    const [overview, nodes] = await Promise.all([api('GET', '/overview' + age), monitor ? api('GET', '/nodes') : null]);
    const q = overview.queue_totals || {};
    const o = overview.object_totals || {};
    clear(document.getElementById('totals')).append(
      h('p', {}, overview.product_name + ' ' + overview.product_version + ' on ' + overview.node),
      table([
        ['Ready', (r) => fmt.num(r.messages_ready), 'num'],
        ['Unacked', (r) => fmt.num(r.messages_unacknowledged), 'num'],
        ['Total', (r) => fmt.num(r.messages), 'num'],
        ['Queues', () => fmt.num(o.queues), 'num'],
        ['Exchanges', () => fmt.num(o.exchanges), 'num'],
        ['Connections', () => fmt.num(o.connections), 'num'],
        ['Channels', () => fmt.num(o.channels), 'num'],
        ['Consumers', () => fmt.num(o.consumers), 'num'],
      ], [q]));
    const queued = [
      { name: 'Ready', color: '#e0a020', points: levelPoints(q.messages_ready_details) },
      { name: 'Unacked', color: '#3a78c2', points: levelPoints(q.messages_unacknowledged_details) },
    ];
    drawChart(document.getElementById('queued-chart'), queued, '');
    legend('queued-chart', queued, (s) => fmt.num(s.points.length ? s.points[s.points.length - 1][1] : 0));
    const m = overview.message_stats || {};
    const rates = [
      { name: 'Publish', color: '#e0a020', points: ratePoints(m.publish_details), rate: m.publish_details },
      { name: 'Deliver / get', color: '#3a78c2', points: ratePoints(m.deliver_get_details), rate: m.deliver_get_details },
      { name: 'Ack', color: '#4a9a4a', points: ratePoints(m.ack_details), rate: m.ack_details },
      { name: 'Redeliver', color: '#a03030', points: ratePoints(m.redeliver_details), rate: m.redeliver_details },
    ];
    drawChart(document.getElementById('rates-chart'), rates, '/s');
    legend('rates-chart', rates, (s) => fmt.rate(s.rate) || '0.0/s');
    if (!monitor) return;
    clear(document.getElementById('nodes')).append(table([
      ['Name', (n) => n.name],
      ['Running', (n) => (n.running ? h('span', { class: 'good' }, 'yes') : h('span', { class: 'bad' }, 'no'))],
      ['Memory', (n) => (n.mem_used === undefined ? '' : h('span', { class: n.mem_alarm ? 'bad' : '' }, fmt.bytes(n.mem_used) + ' of ' + fmt.bytes(n.mem_limit)))],
      ['Disk free', (n) => (n.disk_free === undefined ? '' : h('span', { class: n.disk_free_alarm ? 'bad' : '' }, fmt.bytes(n.disk_free) + ' (limit ' + fmt.bytes(n.disk_free_limit) + ')'))],
      ['File descriptors', (n) => (n.fd_used === undefined ? '' : fmt.num(n.fd_used) + ' of ' + fmt.num(n.fd_total))],
      ['Uptime', (n) => (n.uptime === undefined ? '' : fmt.uptime(n.uptime))],
    ], nodes));
  };
};

async function vhostOptions() {
  const vhosts = await api('GET', '/vhosts?columns=name');
  return vhosts.map((v) => h('option', { value: v.name }, v.name));
}

pages.queues = async (main) => {
  const form = h('form', { class: 'inline', id: 'add-queue' },
    h('label', {}, 'Virtual host ', h('select', { name: 'vhost' }, await vhostOptions())),
    h('label', {}, 'Name ', h('input', { type: 'text', name: 'name', required: true, maxlength: 255 })),
    h('label', {}, 'Type ', h('select', { name: 'type' }, h('option', { value: 'classic' }, 'classic'), h('option', { value: 'quorum' }, 'quorum'))),
    h('label', {}, h('input', { type: 'checkbox', name: 'durable', checked: true }), ' durable'),
    h('button', { type: 'submit' }, 'Add queue'));
  form.addEventListener('submit', (e) => {
    e.preventDefault();
    const f = form.elements;
    act(() => api('PUT', '/queues/' + enc(f.vhost.value) + '/' + enc(f.name.value),
      { durable: f.durable.checked || f.type.value === 'quorum', auto_delete: false, arguments: { 'x-queue-type': f.type.value } }),
      'Queue ' + f.name.value + ' added.');
  });
  main.append(h('h1', {}, 'Queues'), h('div', { id: 'queues' }), h('h2', {}, 'Add a queue'), form);
  return async () => {
    const queues = await api('GET', '/queues');
    const stats = (q, key) => fmt.rate((q.message_stats || {})[key + '_details']);
    clear(document.getElementById('queues')).append(table([
      ['Virtual host', (q) => q.vhost],
      ['Name', (q) => link(queueHash(q), q.name)],
      ['Type', (q) => q.type],
      ['Node / leader', (q) => q.leader || q.node],
      ['Members', (q) => (q.members ? q.members.join(', ') : '')],
      ['Consumers', (q) => fmt.num(q.consumers), 'num'],
      ['Ready', (q) => fmt.num(q.messages_ready), 'num'],
      ['Unacked', (q) => fmt.num(q.messages_unacknowledged), 'num'],
      ['Total', (q) => fmt.num(q.messages), 'num'],
      ['Incoming', (q) => stats(q, 'publish'), 'num'],
      ['Deliver / get', (q) => stats(q, 'deliver_get'), 'num'],
      ['Ack', (q) => stats(q, 'ack'), 'num'],
    ], queues, 'No queues yet.'));
  };
};

pages.queue = (main, vhost, name) => {
  const path = '/queues/' + enc(vhost) + '/' + enc(name);
  const publish = publishForm(vhost, 'amq.default', name);
  const got = h('div', { id: 'got' });
  const get = h('form', { class: 'inline', id: 'get' },
    h('label', {}, 'Ack mode ', h('select', { name: 'ackmode' },
      h('option', { value: 'ack_requeue_true' }, 'Nack, requeue'),
      h('option', { value: 'ack_requeue_false' }, 'Ack (remove)'),
      h('option', { value: 'reject_requeue_false' }, 'Reject, no requeue'))),
    h('label', {}, 'Messages ', h('input', { type: 'number', name: 'count', value: 1, min: 1, max: 1000 })),
    h('button', { type: 'submit' }, 'Get messages'));
  get.addEventListener('submit', (e) => {
    e.preventDefault();
    const f = get.elements;
    act(async () => {
      const messages = await api('POST', path + '/get', { count: Number(f.count.value), ackmode: f.ackmode.value, encoding: 'auto', truncate: 50000 });
      clear(got).append(...(messages.length ? messages.map((m, i) => h('div', { class: 'message' },
        h('strong', {}, 'Message ' + (i + 1)), ' exchange ' + JSON.stringify(m.exchange) + ', routing key ' + JSON.stringify(m.routing_key) + (m.redelivered ? ', redelivered' : ''),
        h('pre', { class: 'payload' }, m.payload))) : [h('p', { class: 'muted' }, 'The queue is empty.')]));
    });
  });
  const rewind = h('form', { class: 'inline', id: 'rewind' },
    h('label', {}, 'To ', h('input', { type: 'text', name: 'to', value: '-1h', size: 26,
      title: 'unix ms, an RFC 3339 time (2026-11-29T10:00:00Z) or a time ago (-90m, -2h, -1d)' })),
    h('button', { type: 'submit' }, 'Rewind'));
  rewind.addEventListener('submit', (e) => {
    e.preventDefault();
    const to = rewind.elements.to.value.trim();
    let answer = {};
    act(async () => { answer = await api('POST', path + '/rewind', { to: /^[0-9]+$/.test(to) ? Number(to) : to }); },
      () => 'Rewound ' + fmt.num(answer.rewound) + ' messages' + (answer.from ? ' from ' + new Date(answer.from).toISOString() : '')
        + (answer.clamped ? ' (the oldest the queue keeps)' : '') + '.');
  });
  main.append(
    h('h1', {}, 'Queue ', h('span', { id: 'queue-name' }, name), h('span', { class: 'muted' }, ' in ' + vhost)),
    h('div', { id: 'queue' }),
    h('h2', {}, 'Bindings'), h('div', { id: 'bindings' }),
    h('h2', {}, 'Publish a message'), publish,
    h('h2', {}, 'Get messages'), get, got,
    h('h2', {}, 'Rewind'),
    h('p', { class: 'muted' }, 'A classic queue with x-retention-seconds keeps what was consumed: a rewind makes what was published since then ready again.'),
    rewind,
    h('h2', {}, 'Purge or delete'),
    dangerButton('Purge', () => act(() => api('DELETE', path + '/contents'), 'Queue purged.')), ' ',
    dangerButton('Delete', () => act(async () => { await api('DELETE', path); location.hash = '#/queues'; }, 'Queue deleted.')));
  return async () => {
    const [q, bindings] = await Promise.all([api('GET', path), api('GET', path + '/bindings')]);
    const m = q.message_stats || {};
    clear(document.getElementById('queue')).append(table([
      ['Type', () => q.type],
      ['Node / leader', () => q.leader || q.node],
      ['Members (online)', () => (q.members ? q.members.join(', ') + ' (' + (q.online || []).join(', ') + ')' : '')],
      ['Durable', () => (q.durable ? 'yes' : 'no')],
      ['Arguments', () => fmt.args(q.arguments)],
      ['Consumers', () => fmt.num(q.consumers), 'num'],
      ['Ready', () => fmt.num(q.messages_ready), 'num'],
      ['Unacked', () => fmt.num(q.messages_unacknowledged), 'num'],
      ['Total', () => fmt.num(q.messages), 'num'],
      ['Retained', () => (q.messages_retained === undefined ? '' : fmt.num(q.messages_retained)), 'num'],
      ['Delayed', () => fmt.num(q.messages_delayed || 0), 'num'],
      ['Incoming', () => fmt.rate(m.publish_details), 'num'],
      ['Deliver / get', () => fmt.rate(m.deliver_get_details), 'num'],
      ['Ack', () => fmt.rate(m.ack_details), 'num'],
    ], [q]));
    clear(document.getElementById('bindings')).append(table([
      ['From', (b) => link(exchangeHash({ vhost: b.vhost, name: b.source }), b.source === '' ? '(default exchange)' : b.source)],
      ['Routing key', (b) => b.routing_key],
      ['Arguments', (b) => fmt.args(b.arguments)],
    ], bindings));
  };
};

pages.exchanges = async (main) => {
  const form = h('form', { class: 'inline', id: 'add-exchange' },
    h('label', {}, 'Virtual host ', h('select', { name: 'vhost' }, await vhostOptions())),
    h('label', {}, 'Name ', h('input', { type: 'text', name: 'name', required: true, maxlength: 255 })),
    // A delayed exchange (x-delayed-message) routes as its x-delayed-type: "delayed topic" and so on.
    h('label', {}, 'Type ', h('select', { name: 'type' }, ['direct', 'fanout', 'topic', 'headers'].flatMap((t) => [t, 'delayed ' + t]).map((t) => h('option', { value: t }, t)))),
    h('label', {}, h('input', { type: 'checkbox', name: 'durable', checked: true }), ' durable'),
    h('button', { type: 'submit' }, 'Add exchange'));
  form.addEventListener('submit', (e) => {
    e.preventDefault();
    const f = form.elements;
    const delayed = f.type.value.startsWith('delayed ');
    const body = delayed
      ? { type: 'x-delayed-message', arguments: { 'x-delayed-type': f.type.value.slice(8) } }
      : { type: f.type.value, arguments: {} };
    act(() => api('PUT', '/exchanges/' + enc(f.vhost.value) + '/' + enc(f.name.value), { ...body, durable: f.durable.checked, auto_delete: false, internal: false }),
      'Exchange ' + f.name.value + ' added.');
  });
  main.append(h('h1', {}, 'Exchanges'), h('div', { id: 'exchanges' }), h('h2', {}, 'Add an exchange'), form);
  return async () => {
    const exchanges = await api('GET', '/exchanges');
    clear(document.getElementById('exchanges')).append(table([
      ['Virtual host', (e) => e.vhost],
      ['Name', (e) => link(exchangeHash(e), e.name === '' ? '(AMQP default)' : e.name)],
      ['Type', (e) => e.type],
      ['Durable', (e) => (e.durable ? 'yes' : 'no')],
      ['Internal', (e) => (e.internal ? 'yes' : '')],
      ['Arguments', (e) => fmt.args(e.arguments)],
    ], exchanges));
  };
};

pages.exchange = (main, vhost, name) => {
  const path = '/exchanges/' + enc(vhost) + '/' + enc(name);
  const bind = h('form', { class: 'inline', id: 'bind' },
    h('label', {}, 'To queue ', h('input', { type: 'text', name: 'queue', required: true })),
    h('label', {}, 'Routing key ', h('input', { type: 'text', name: 'key' })),
    h('button', { type: 'submit' }, 'Bind'));
  bind.addEventListener('submit', (e) => {
    e.preventDefault();
    const f = bind.elements;
    act(() => api('POST', '/bindings/' + enc(vhost) + '/e/' + enc(name) + '/q/' + enc(f.queue.value), { routing_key: f.key.value, arguments: {} }), 'Bound.');
  });
  const publish = publishForm(vhost, name, null);
  main.append(
    h('h1', {}, 'Exchange ', h('span', {}, name), h('span', { class: 'muted' }, ' in ' + vhost)),
    h('div', { id: 'exchange' }),
    h('h2', {}, 'Bindings from this exchange'), h('div', { id: 'bindings' }), bind,
    h('h2', {}, 'Publish a message'), publish,
    name.startsWith('amq.') ? null : h('div', {}, h('h2', {}, 'Delete'),
      dangerButton('Delete', () => act(async () => { await api('DELETE', path); location.hash = '#/exchanges'; }, 'Exchange deleted.'))));
  return async () => {
    const [x, bindings] = await Promise.all([api('GET', path), api('GET', path + '/bindings/source')]);
    clear(document.getElementById('exchange')).append(table([
      ['Type', () => x.type], ['Durable', () => (x.durable ? 'yes' : 'no')], ['Arguments', () => fmt.args(x.arguments)],
    ], [x]));
    clear(document.getElementById('bindings')).append(table([
      ['To', (b) => (b.destination_type === 'queue' ? link(queueHash({ vhost: b.vhost, name: b.destination }), b.destination) : link(exchangeHash({ vhost: b.vhost, name: b.destination }), b.destination))],
      ['Kind', (b) => b.destination_type],
      ['Routing key', (b) => b.routing_key],
      ['Arguments', (b) => fmt.args(b.arguments)],
      ['', (b) => dangerButton('Unbind', () => act(() => api('DELETE', '/bindings/' + enc(vhost) + '/e/' + enc(name) + '/' + (b.destination_type === 'queue' ? 'q' : 'e') + '/' + enc(b.destination) + '/' + enc(b.properties_key)), 'Unbound.'))],
    ], bindings));
  };
};

pages.connections = (main) => {
  main.append(h('h1', {}, 'Connections'), h('div', { id: 'connections' }));
  return async () => {
    const connections = await api('GET', '/connections');
    clear(document.getElementById('connections')).append(table([
      ['Name', (c) => c.name],
      ['User', (c) => c.user],
      ['Virtual host', (c) => c.vhost],
      ['Client', (c) => { const p = c.client_properties || {}; return [p.product, p.version].filter(Boolean).join(' '); }],
      ['Channels', (c) => fmt.num(c.channels), 'num'],
      ['Connected at', (c) => (c.connected_at ? new Date(c.connected_at).toLocaleString() : '')],
      ['', (c) => dangerButton('Close', () => act(() => api('DELETE', '/connections/' + enc(c.name), undefined, { 'X-Reason': 'Closed from the management UI' }), 'Connection closed.'))],
    ], connections, 'No connections.'));
  };
};

pages.channels = (main) => {
  main.append(h('h1', {}, 'Channels'), h('div', { id: 'channels' }));
  return async () => {
    const channels = await api('GET', '/channels');
    clear(document.getElementById('channels')).append(table([
      ['Channel', (c) => c.name], ['User', (c) => c.user], ['Virtual host', (c) => c.vhost], ['State', (c) => c.state],
    ], channels, 'No channels.'));
  };
};

// ---- Admin: users, virtual hosts, permissions (administrator users: the API refuses others) -

const userHash = (name) => '#/users/' + enc(name);
const tagList = (tags) => (Array.isArray(tags) ? tags.join(', ') : tags || '');

// What each element was last filled from: a refresh that brings the same rows leaves the element
// as it is (a danger button stays armed between its two presses, an open select stays open).
const shown = new WeakMap();
function update(id, data, build) {
  const el = document.getElementById(id);
  const key = JSON.stringify(data);
  if (shown.get(el) === key) return;
  shown.set(el, key);
  clear(el).append(build());
}

// A select's options set to `names`, keeping what is chosen (vhosts come and go while a form is open).
function fillSelect(select, names) {
  const same = select.options.length === names.length && names.every((n, i) => select.options[i].value === n);
  if (same) return;
  const chosen = select.value;
  clear(select).append(...names.map((n) => h('option', { value: n }, n)));
  if (names.includes(chosen)) select.value = chosen;
}

// Whether the object at `path` exists (404: no); any other error is thrown.
async function exists(path) {
  try {
    await api('GET', path);
    return true;
  } catch (e) {
    if (e instanceof ApiError && e.status === 404) return false;
    throw e;
  }
}

function adminNav(current) {
  return h('nav', { class: 'sub', id: 'admin-nav' }, [['users', 'Users'], ['vhosts', 'Virtual hosts'], ['permissions', 'Permissions']]
    .map(([tab, title]) => h('a', { href: '#/' + tab, class: tab === current ? 'current' : '' }, title)));
}

pages.users = (main) => {
  const form = h('form', { class: 'inline', id: 'add-user' },
    h('label', {}, 'Name ', h('input', { type: 'text', name: 'name', required: true, maxlength: 255, autocomplete: 'off' })),
    h('label', {}, 'Password ', h('input', { type: 'password', name: 'password', autocomplete: 'new-password', title: 'empty: a user with no password, who cannot log in with one' })),
    h('label', {}, 'Tags ', h('input', { type: 'text', name: 'tags', size: 30, title: 'comma-separated: administrator, monitoring, policymaker, management, or your own' })),
    h('button', { type: 'submit' }, 'Add user'));
  form.addEventListener('submit', (e) => {
    e.preventDefault();
    const f = form.elements;
    const name = f.name.value;
    act(async () => {
      // A PUT would replace an existing user's password and tags: that is its own page's to do.
      if (await exists('/users/' + enc(name))) throw new ApiError('User ' + name + ' already exists: change it on its page.');
      const body = { tags: f.tags.value };
      if (f.password.value) body.password = f.password.value;
      await api('PUT', '/users/' + enc(name), body);
      form.reset();
    }, 'User ' + name + ' added.');
  });
  main.append(adminNav('users'), h('h1', {}, 'Users'), h('div', { id: 'users' }), h('h2', {}, 'Add a user'), form);
  return async () => {
    const [users, permissions] = await Promise.all([api('GET', '/users'), api('GET', '/permissions')]);
    const rows = users.map((u) => ({
      name: u.name, tags: tagList(u.tags), password: Boolean(u.password_hash),
      vhosts: permissions.filter((p) => p.user === u.name).map((p) => p.vhost).sort(),
    }));
    update('users', rows, () => table([
      ['Name', (u) => link(userHash(u.name), u.name)],
      ['Tags', (u) => u.tags],
      ['Can access virtual hosts', (u) => (u.vhosts.length ? u.vhosts.join(', ') : h('span', { class: 'muted' }, 'No access'))],
      ['Has password', (u) => (u.password ? 'yes' : 'no')],
    ], rows, 'No users.'));
  };
};

pages.user = async (main, name) => {
  const path = '/users/' + enc(name);
  let user;
  try {
    user = await api('GET', path);
  } catch (e) {
    throw e instanceof ApiError && e.status === 404 ? new ApiError('There is no user ' + name + '.', 404) : e;
  }
  const permission = h('form', { class: 'inline', id: 'set-permission' },
    h('label', {}, 'Virtual host ', h('select', { name: 'vhost' }, await vhostOptions())),
    ['configure', 'write', 'read'].map((key) => h('label', {}, key[0].toUpperCase() + key.slice(1) + ' ', h('input', { type: 'text', name: key, value: '.*', size: 12 }))),
    h('button', { type: 'submit' }, 'Set permission'));
  permission.addEventListener('submit', (e) => {
    e.preventDefault();
    const f = permission.elements;
    const vhost = f.vhost.value;
    act(() => api('PUT', '/permissions/' + enc(vhost) + '/' + enc(name), { configure: f.configure.value, write: f.write.value, read: f.read.value }),
      'Permission on ' + vhost + ' set.');
  });
  const password = h('form', { class: 'inline', id: 'change-password' },
    h('label', {}, 'New password ', h('input', { type: 'password', name: 'password', required: true, autocomplete: 'new-password' })),
    h('button', { type: 'submit' }, 'Change password'));
  password.addEventListener('submit', (e) => {
    e.preventDefault();
    act(async () => {
      // A PUT sets all of a user: its tags as they are now go with the new password.
      const now = await api('GET', path);
      await api('PUT', path, { password: password.elements.password.value, tags: now.tags });
      password.reset();
    }, 'Password changed.');
  });
  const tags = h('form', { class: 'inline', id: 'set-tags' },
    h('label', {}, 'Tags ', h('input', { type: 'text', name: 'tags', size: 40, value: tagList(user.tags), title: 'comma-separated; empty: no tags (no management API)' })),
    h('button', { type: 'submit' }, 'Set tags'));
  tags.addEventListener('submit', (e) => {
    e.preventDefault();
    act(async () => {
      // The password stays: its hash goes back as it is (as `warren ctl set-user-tags` does).
      const now = await api('GET', path);
      await api('PUT', path, { password_hash: now.password_hash, hashing_algorithm: now.hashing_algorithm, tags: tags.elements.tags.value });
    }, 'Tags set.');
  });
  main.append(
    adminNav('users'),
    h('h1', {}, 'User ', h('span', { id: 'user-name' }, name)),
    h('div', { id: 'user-info' }),
    h('h2', {}, 'Permissions'), h('div', { id: 'user-permissions' }), permission,
    h('h2', {}, 'Change password'), password,
    h('h2', {}, 'Tags'), tags,
    h('h2', {}, 'Delete'),
    dangerButton('Delete user', () => act(async () => { await api('DELETE', path); location.hash = '#/users'; }, 'User ' + name + ' deleted.')));
  return async () => {
    const [now, permissions, vhosts] = await Promise.all([api('GET', path), api('GET', path + '/permissions'), api('GET', '/vhosts?columns=name')]);
    fillSelect(permission.elements.vhost, vhosts.map((v) => v.name));
    const info = { tags: tagList(now.tags), password: Boolean(now.password_hash) };
    update('user-info', info, () => table([['Tags', () => info.tags], ['Has password', () => (info.password ? 'yes' : 'no')]], [info]));
    update('user-permissions', permissions, () => table([
      ['Virtual host', (p) => p.vhost],
      ['Configure', (p) => p.configure],
      ['Write', (p) => p.write],
      ['Read', (p) => p.read],
      ['', (p) => dangerButton('Clear', () => act(() => api('DELETE', '/permissions/' + enc(p.vhost) + '/' + enc(name)), 'Permission on ' + p.vhost + ' cleared.'))],
    ], permissions, 'No permissions: this user cannot open a connection to any virtual host.'));
  };
};

const VHOST_LIMITS = [['max-connections', 'Max connections'], ['max-queues', 'Max queues']];

pages.vhosts = (main) => {
  const add = h('form', { class: 'inline', id: 'add-vhost' },
    h('label', {}, 'Name ', h('input', { type: 'text', name: 'name', required: true, maxlength: 255, autocomplete: 'off' })),
    h('label', {}, 'Description ', h('input', { type: 'text', name: 'description', size: 30 })),
    h('button', { type: 'submit' }, 'Add virtual host'));
  add.addEventListener('submit', (e) => {
    e.preventDefault();
    const f = add.elements;
    const name = f.name.value;
    act(async () => {
      // A PUT on an existing one would clear its tags.
      if (await exists('/vhosts/' + enc(name))) throw new ApiError('Virtual host ' + name + ' already exists.');
      await api('PUT', '/vhosts/' + enc(name), { description: f.description.value });
      add.reset();
    }, 'Virtual host ' + name + ' added (you have every permission on it).');
  });
  const limit = h('form', { class: 'inline', id: 'set-limit' },
    h('label', {}, 'Virtual host ', h('select', { name: 'vhost' })),
    h('label', {}, 'Limit ', h('select', { name: 'limit' }, VHOST_LIMITS.map(([key]) => h('option', { value: key }, key)))),
    h('label', {}, 'Value ', h('input', { type: 'number', name: 'value', min: 0, step: 1, required: true })),
    h('button', { type: 'submit' }, 'Set limit'));
  limit.addEventListener('submit', (e) => {
    e.preventDefault();
    const f = limit.elements;
    const [vhost, key, value] = [f.vhost.value, f.limit.value, Number(f.value.value)];
    act(() => api('PUT', '/vhost-limits/' + enc(vhost) + '/' + enc(key), { value }), 'Limit ' + key + ' of ' + vhost + ' set to ' + value + '.');
  });
  main.append(adminNav('vhosts'), h('h1', {}, 'Virtual hosts'), h('div', { id: 'vhosts' }),
    h('h2', {}, 'Add a virtual host'), add,
    h('h2', {}, 'Set a limit'), limit);
  return async () => {
    const [vhosts, limits] = await Promise.all([api('GET', '/vhosts'), api('GET', '/vhost-limits')]);
    fillSelect(limit.elements.vhost, vhosts.map((v) => v.name));
    const rows = vhosts.map((v) => ({
      name: v.name, description: v.description, tags: tagList(v.tags), ready: v.messages_ready, unacked: v.messages_unacknowledged,
      limits: (limits.find((l) => l.vhost === v.name) || {}).value || {},
    }));
    const limitCell = (key) => (v) => (v.limits[key] === undefined || v.limits[key] === null ? '' : [fmt.num(v.limits[key]) + ' ',
      h('button', { type: 'button', class: 'small', on: { click: () => act(() => api('DELETE', '/vhost-limits/' + enc(v.name) + '/' + enc(key)), 'Limit ' + key + ' of ' + v.name + ' cleared.') } }, 'Clear')]);
    update('vhosts', rows, () => table([
      ['Name', (v) => v.name],
      ['Description', (v) => v.description],
      ['Tags', (v) => v.tags],
      ['Ready', (v) => fmt.num(v.ready), 'num'],
      ['Unacked', (v) => fmt.num(v.unacked), 'num'],
      ...VHOST_LIMITS.map(([key, title]) => [title, limitCell(key), 'num']),
      ['', (v) => dangerButton('Delete', () => act(() => api('DELETE', '/vhosts/' + enc(v.name)), 'Virtual host ' + v.name + ' deleted.'))],
    ], rows, 'No virtual hosts.'));
  };
};

pages.permissions = (main) => {
  main.append(adminNav('permissions'), h('h1', {}, 'Permissions'), h('div', { id: 'permissions' }),
    h('p', { class: 'muted' }, 'A user\'s permissions are set and cleared on its page (Users).'));
  return async () => {
    const permissions = await api('GET', '/permissions');
    update('permissions', permissions, () => table([
      ['User', (p) => link(userHash(p.user), p.user)],
      ['Virtual host', (p) => p.vhost],
      ['Configure', (p) => p.configure],
      ['Write', (p) => p.write],
      ['Read', (p) => p.read],
    ], permissions, 'No permissions.'));
  };
};

// ---- Navigation, refresh, login -----------------------------------------------------------

function route() {
  const parts = location.hash.replace(/^#\/?/, '').split('/').map(decodeURIComponent);
  switch (parts[0]) {
    case 'queues': return parts.length >= 3 ? ['queue', 'queues', parts[1], parts.slice(2).join('/')] : ['queues', 'queues'];
    case 'exchanges': return parts.length >= 3 ? ['exchange', 'exchanges', parts[1], parts.slice(2).join('/')] : ['exchanges', 'exchanges'];
    case 'connections': return ['connections', 'connections'];
    case 'channels': return ['channels', 'channels'];
    // The Admin pages: the navigation's "Admin" (#/users) stays marked on each.
    case 'users': return parts.length >= 2 && parts[1] !== '' ? ['user', 'users', parts.slice(1).join('/')] : ['users', 'users'];
    case 'vhosts': return ['vhosts', 'users'];
    case 'permissions': return ['permissions', 'users'];
    default: return ['overview', ''];
  }
}

async function refresh() {
  if (!state.page) return;
  try {
    await state.page.refresh();
  } catch (e) {
    if (!(e instanceof ApiError && e.message === 'not logged in')) flash(e.message, true);
  }
}

async function show() {
  clearInterval(state.timer);
  if (!state.auth) return showLogin();
  const [page, tab, ...args] = route();
  for (const a of document.querySelectorAll('#nav a')) a.classList.toggle('current', a.getAttribute('href') === '#/' + tab);
  const main = clear(document.getElementById('main'));
  flash('');
  try {
    state.page = { refresh: await pages[page](main, ...args) };
  } catch (e) {
    flash(e.message, true);
    return;
  }
  await refresh();
  state.timer = setInterval(refresh, REFRESH_MS);
}

function showLogin(message) {
  state.page = null;
  document.getElementById('nav').hidden = true;
  clear(document.getElementById('who'));
  const form = h('form', { id: 'login', class: 'panel' },
    h('h1', {}, 'Log in'),
    h('label', {}, 'User name', h('br'), h('input', { type: 'text', name: 'username', autocomplete: 'username', required: true })),
    h('label', {}, 'Password', h('br'), h('input', { type: 'password', name: 'password', autocomplete: 'current-password' })),
    h('button', { type: 'submit' }, 'Log in'));
  form.addEventListener('submit', async (e) => {
    e.preventDefault();
    const f = form.elements;
    // btoa takes Latin-1: encode the UTF-8 bytes of the credentials first.
    const bytes = new TextEncoder().encode(f.username.value + ':' + f.password.value);
    state.auth = btoa(String.fromCharCode(...bytes));
    try {
      const response = await fetch('/api/whoami', { headers: { Authorization: 'Basic ' + state.auth, 'X-Requested-With': 'XMLHttpRequest' } });
      if (!response.ok) throw new ApiError(response.status === 401 ? 'Login failed: wrong user name or password.' : 'Login failed: ' + response.status);
      sessionStorage.setItem('warren-auth', state.auth);
      await loggedIn();
    } catch (err) {
      state.auth = null;
      flash(err.message, true);
    }
  });
  clear(document.getElementById('main')).append(form);
  if (message) flash(message, true);
}

async function loggedIn() {
  const me = await api('GET', '/whoami');
  state.user = me.name;
  state.tags = Array.isArray(me.tags) ? me.tags : String(me.tags || '').split(',').map((t) => t.trim());
  document.getElementById('nav-admin').hidden = !isAdministrator();
  document.getElementById('nav').hidden = false;
  clear(document.getElementById('who')).append('User ', h('strong', { id: 'user' }, me.name), h('button', { type: 'button', id: 'logout', on: { click: () => logout() } }, 'Log out'));
  await show();
}

function logout(message) {
  clearInterval(state.timer);
  state.auth = null;
  state.user = null;
  state.tags = [];
  document.getElementById('nav-admin').hidden = true;
  sessionStorage.removeItem('warren-auth');
  showLogin(message);
}

window.addEventListener('hashchange', () => { if (state.user) show(); });
document.addEventListener('DOMContentLoaded', () => (state.auth ? loggedIn().catch(() => logout()) : showLogin()));
