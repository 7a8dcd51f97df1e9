// The left-sidebar panel: allocators, hosts, meshes (one element per rank, coloured by state),
// debug sessions and recent logs, polled about once a second while the panel is visible.
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import { IAllocator, IDebugSession, IHost, IJob, ILogLine, IMesh, IState, getState } from './api';

/** What the panel asks its host application to do (kept out of the view so it stays testable). */
export interface ISidebarActions {
  startAllocator(): Promise<void>;
  stopMesh(mesh: IMesh): Promise<void>;
  openLog(mesh: string, rank: number): void;
  insertCell(code: string): void;
}

export const POLL_MS = 1000;

type Section = 'allocators' | 'hosts' | 'meshes' | 'jobs' | 'debug' | 'logs';

function el<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  cls = '',
  text = '',
  attrs: { [k: string]: string } = {}
): HTMLElementTagNameMap[K] {
  const e = document.createElement(tag);
  if (cls) {
    e.className = cls;
  }
  if (text) {
    e.textContent = text;
  }
  for (const k of Object.keys(attrs)) {
    e.setAttribute(k, attrs[k]);
  }
  return e;
}

/** A CSS-safe state class: mnb-state-idle, mnb-state-failed, ... */
export function stateClass(state: string): string {
  return 'mnb-state-' + (state || 'unknown').replace(/[^a-z0-9_-]/gi, '-').toLowerCase();
}

function button(cls: string, label: string, title: string, onClick: () => void): HTMLButtonElement {
  const b = el('button', `jp-Button mnb-button ${cls}`, label, { title, type: 'button' });
  b.addEventListener('click', ev => {
    ev.stopPropagation();
    onClick();
  });
  return b;
}

/** What identifies a focusable element across a re-render: its classes and the data attributes of
 * it and its ancestors (which mesh, which rank), less its state, which is what changed. */
function focusKey(e: HTMLElement, root: HTMLElement): string {
  const parts: string[] = [];
  for (let n: HTMLElement | null = e; n && n !== root; n = n.parentElement) {
    const attrs = Array.from(n.attributes)
      .filter(a => a.name.startsWith('data-') && a.name !== 'data-state')
      .map(a => `${a.name}=${a.value}`);
    const cls = Array.from(n.classList).filter(c => !c.startsWith('mnb-state-'));
    parts.push(`${n.tagName}.${cls.join('.')}[${attrs.join(',')}]`);
  }
  return parts.join('<');
}

/** 75 -> "1m15s", 4000 -> "1h06m" (as %mesh jobs writes them) */
export function duration(seconds: number): string {
  const v = Math.max(0, Math.floor(seconds));
  const pad = (n: number) => String(n).padStart(2, '0');
  return v >= 3600 ? `${Math.floor(v / 3600)}h${pad(Math.floor((v % 3600) / 60))}m` : `${Math.floor(v / 60)}m${pad(v % 60)}s`;
}

export class MeshSidebar extends Widget {
  constructor(private actions: ISidebarActions) {
    super();
    this.id = 'monarch-nb-sidebar';
    this.addClass('mnb-Sidebar');
    this.title.caption = 'monarch_nb: allocators, meshes, logs';

    const header = el('div', 'mnb-header');
    header.appendChild(el('h2', 'mnb-title', 'Monarch meshes'));
    this._start = button('mnb-start-allocator', 'Start allocator', 'Start the embedded allocator on the Jupyter server host', () => {
      void this.actions.startAllocator();
    });
    header.appendChild(this._start);
    this.node.appendChild(header);
    this._status = el('div', 'mnb-status', 'connecting…');
    this.node.appendChild(this._status);
    // the dashboard's legend: the states and colours the server sends
    this._legend = el('div', 'mnb-legend');
    this.node.appendChild(this._legend);

    const titles: [Section, string][] = [
      ['allocators', 'Allocators'],
      ['hosts', 'Hosts'],
      ['meshes', 'Meshes'],
      ['jobs', 'Jobs'],
      ['debug', 'Debug sessions'],
      ['logs', 'Recent logs']
    ];
    for (const [key, title] of titles) {
      const section = el('section', `mnb-section mnb-section-${key}`);
      section.appendChild(el('h3', 'mnb-section-title', title));
      const body = el('div', 'mnb-section-body');
      section.appendChild(body);
      this.node.appendChild(section);
      this._bodies.set(key, body);
    }
  }

  /** Fetch now (after an action, or on show) and re-render what changed. */
  async refresh(): Promise<void> {
    if (this._inflight) {
      this._again = true;
      return;
    }
    this._inflight = true;
    try {
      const state = await getState();
      this._status.textContent = `updated ${new Date(state.time * 1000).toLocaleTimeString()}`;
      this._status.classList.remove('mnb-error');
      this.render(state);
    } catch (e) {
      this._status.textContent = `${e}`;
      this._status.classList.add('mnb-error');
    } finally {
      this._inflight = false;
    }
    if (this._again) {
      this._again = false;
      void this.refresh();
    }
  }

  render(state: IState): void {
    // one legend for the sidebar and the dashboard: the server's colours, as CSS variables
    for (const s of Object.keys(state.colours || {})) {
      this.node.style.setProperty(`--mnb-${s}`, state.colours[s]);
    }
    const legend = JSON.stringify(state.legend || {});
    if (legend !== this._legendJson) {
      this._legendJson = legend;
      this._legend.replaceChildren(
        ...Object.keys(state.legend || {}).map(s => {
          const item = el('span', 'mnb-legend-item', '', { 'data-state': s });
          item.appendChild(el('span', `mnb-swatch ${stateClass(s)}`));
          item.appendChild(document.createTextNode(s));
          return item;
        })
      );
    }
    // no second allocator on this host: it is running already
    this._start.style.display = state.local_allocator ? 'none' : '';
    this._renderSection('allocators', state.allocators, () => this._allocators(state.allocators));
    this._renderSection('hosts', state.hosts, () => this._hosts(state.hosts));
    this._renderSection('meshes', state.meshes, () => this._meshes(state.meshes));
    this._renderSection('jobs', state.jobs || [], () => this._jobs(state.jobs || []));
    this._renderSection('debug', state.debug_sessions, () => this._debug(state.debug_sessions));
    this._renderSection('logs', state.logs, () => this._logs(state.logs));
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    this._startPolling();
  }

  protected onAfterAttach(msg: Message): void {
    super.onAfterAttach(msg);
    if (this.isVisible) {
      this._startPolling();
    }
  }

  protected onBeforeHide(msg: Message): void {
    this._stopPolling();
    super.onBeforeHide(msg);
  }

  protected onBeforeDetach(msg: Message): void {
    this._stopPolling();
    super.onBeforeDetach(msg);
  }

  dispose(): void {
    this._stopPolling();
    super.dispose();
  }

  private _startPolling(): void {
    if (this._timer !== null) {
      return;
    }
    const tick = async () => {
      await this.refresh();
      if (this._timer !== null) {
        this._timer = window.setTimeout(tick, POLL_MS);
      }
    };
    this._timer = window.setTimeout(tick, 0);
  }

  private _stopPolling(): void {
    if (this._timer !== null) {
      window.clearTimeout(this._timer);
      this._timer = null;
    }
  }

  // Re-render a section only when its data changed, so hovering and clicking stay steady.
  private _renderSection(key: Section, data: unknown, build: () => HTMLElement[]): void {
    const json = JSON.stringify(data);
    if (this._last.get(key) === json) {
      return;
    }
    this._last.set(key, json);
    const body = this._bodies.get(key)!;
    const active = document.activeElement;
    const focused = active instanceof HTMLElement && body.contains(active) ? focusKey(active, body) : null;
    body.replaceChildren(...build());
    // a keyboard user on rank 5 stays there when another rank changes state (the section is rebuilt)
    if (focused !== null) {
      for (const e of Array.from(body.querySelectorAll<HTMLElement>(active!.tagName))) {
        if (focusKey(e, body) === focused) {
          e.focus({ preventScroll: true });
          break;
        }
      }
    }
  }

  private _empty(text: string): HTMLElement[] {
    return [el('div', 'mnb-empty', text)];
  }

  private _allocators(allocators: IAllocator[]): HTMLElement[] {
    if (!allocators.length) {
      return this._empty('No allocator in this runtime directory. Start one, or run this_host() in a notebook.');
    }
    return allocators.map(a => {
      const row = el('div', `mnb-allocator ${a.alive ? 'mnb-alive' : 'mnb-dead'}`, '', { 'data-addr': a.addr });
      row.appendChild(el('span', 'mnb-name', `${a.host} pid ${a.pid ?? '?'}`));
      row.appendChild(
        el('span', 'mnb-detail', a.alive ? `${a.meshes.length} mesh(es), ${a.controllers} controller(s)` : a.error)
      );
      row.appendChild(el('div', 'mnb-addr', a.tcp || a.addr, { title: a.addr }));
      if (a.alive) {
        row.appendChild(
          button('mnb-insert-connect', 'Insert %mesh connect', 'Insert a cell that connects the notebook to this allocator', () =>
            this.actions.insertCell(`%mesh connect ${a.tcp || a.addr}`)
          )
        );
      }
      return row;
    });
  }

  private _hosts(hosts: IHost[]): HTMLElement[] {
    if (!hosts.length) {
      return this._empty('No hosts.');
    }
    return hosts.map(h => {
      const row = el('div', 'mnb-host', '', { 'data-host': h.host });
      row.appendChild(el('span', 'mnb-name', h.host));
      const states = Object.keys(h.states)
        .sort()
        .map(s => `${h.states[s]} ${s}`)
        .join(', ');
      row.appendChild(el('span', 'mnb-detail', `${h.procs} proc(s)${states ? ': ' + states : ''}`));
      return row;
    });
  }

  private _meshes(meshes: IMesh[]): HTMLElement[] {
    if (!meshes.length) {
      return this._empty('No meshes.');
    }
    return meshes.map(m => {
      const box = el('div', `mnb-mesh ${stateClass(m.state)}`, '', { 'data-mesh': m.name });
      const head = el('div', 'mnb-mesh-head');
      head.appendChild(el('span', 'mnb-name', m.name));
      head.appendChild(el('span', `mnb-badge ${stateClass(m.state)}`, m.label || m.state, { title: m.hint || '' }));
      const dims = m.labels.map((l, i) => `${l}=${m.sizes[i]}`).join(' ');
      head.appendChild(el('span', 'mnb-detail', `${dims} on ${Array.from(new Set(m.hosts)).join(', ')}`));
      const stop = button('mnb-stop-mesh', 'Stop', `Stop mesh ${m.name} and its ${m.procs.length} proc(s)`, () => {
        // one stop at a time: a double-click's second click asked again (a second dialog) and,
        // confirmed, reached the server after the mesh was gone (a 404 toast)
        if (this._stopping.has(m.name)) {
          return;
        }
        this._stopping.add(m.name);
        stop.disabled = true;
        // the second click of a double-click lands on the dialog the first one opened, whose
        // backdrop takes a click for Cancel: it is swallowed, so a double-click asks once as a click does
        const swallow = (ev: MouseEvent) => {
          if (ev.detail > 1) {
            ev.stopPropagation();
            ev.preventDefault();
          }
          window.removeEventListener('click', swallow, true);
        };
        window.addEventListener('click', swallow, true);
        void this.actions.stopMesh(m).finally(() => {
          window.removeEventListener('click', swallow, true);
          this._stopping.delete(m.name);
          // redrawn even if the state did not change (a cancelled dialog): its button is live again
          this._last.delete('meshes');
          void this.refresh();
        });
      });
      // nothing left to stop, or a stop of it is under way
      stop.disabled = m.state === 'stopped' || this._stopping.has(m.name);
      head.appendChild(stop);
      box.appendChild(head);
      if (m.hint) {
        box.appendChild(el('div', 'mnb-hint', m.hint.split('NAME').join(m.name)));
      }

      // one element per rank, laid out by the mesh's last dimension
      const grid = el('div', 'mnb-ranks');
      const cols = m.sizes.length ? m.sizes[m.sizes.length - 1] : m.procs.length;
      grid.style.gridTemplateColumns = `repeat(${Math.max(1, Math.min(cols, 16))}, 1.6em)`;
      for (const p of m.procs) {
        // the allocator's activity says the state itself ("busy in steps.train"): not "busy: busy in"
        const doing = p.state === 'busy' && p.activity && p.activity !== 'busy' ? p.activity : '';
        const what = !doing ? p.state : doing.startsWith(p.state) ? doing : `${p.state}: ${doing}`;
        const tip = [
          `rank ${p.rank} (${what})`,
          `host ${p.host}, pid ${p.pid ?? '?'}`,
          p.cause,
          'click: open its log'
        ]
          .filter(Boolean)
          .join('\n');
        const cell = el('div', `mnb-rank ${stateClass(p.state)}`, String(p.rank), {
          'data-rank': String(p.rank),
          'data-state': p.state,
          title: tip,
          role: 'button',
          tabindex: '0'
        });
        cell.addEventListener('click', () => this.actions.openLog(m.name, p.rank));
        // a role=button answers Enter and Space, as a <button> does (Space would scroll the panel)
        cell.addEventListener('keydown', ev => {
          if (ev.key === 'Enter' || ev.key === ' ') {
            ev.preventDefault();
            this.actions.openLog(m.name, p.rank);
          }
        });
        grid.appendChild(cell);
      }
      box.appendChild(grid);

      const failed = m.procs.filter(p => p.state === 'failed');
      for (const p of failed.slice(0, 8)) {
        box.appendChild(el('div', 'mnb-cause', `rank ${p.rank}: ${p.cause || 'failed'}`, { 'data-rank': String(p.rank) }));
      }
      if (failed.length > 8) {
        box.appendChild(el('div', 'mnb-cause', `… and ${failed.length - 8} more failed rank(s)`));
      }
      return box;
    });
  }

  private _jobs(jobs: IJob[]): HTMLElement[] {
    if (!jobs.length) {
      return this._empty('No jobs (%mesh launch, or monarch-nb job apply).');
    }
    return jobs.map(j => {
      const lost = j.lost && j.lost.length > 0;
      const row = el('div', `mnb-job${lost ? ' mnb-job-lost' : ''}`, '', { 'data-job': j.name, 'data-state': j.state });
      row.appendChild(el('span', 'mnb-name', j.name));
      row.appendChild(el('span', 'mnb-job-state', j.state, { title: j.detail || j.state }));
      const bits = [
        `${j.scheduler}${j.id ? ' ' + j.id : ''}`,
        `${j.hosts} host(s)`,
        j.age_s !== null && j.age_s !== undefined ? `age ${duration(j.age_s)}` : '',
        j.walltime_left_s !== null && j.walltime_left_s !== undefined ? `${duration(j.walltime_left_s)} left` : ''
      ].filter(Boolean);
      row.appendChild(el('span', 'mnb-detail', ' · ' + bits.join(' · ')));
      if (lost) {
        row.appendChild(el('div', 'mnb-lost', `lost: ${j.lost.join(', ')}`));
      }
      return row;
    });
  }

  private _debug(sessions: IDebugSession[]): HTMLElement[] {
    if (!sessions.length) {
      return this._empty('No rank is stopped in a debugger.');
    }
    return sessions.map(s => {
      const rank = s.rank ?? 0;
      const row = el('div', 'mnb-debug', '', { 'data-mesh': String(s.mesh ?? ''), 'data-rank': String(rank) });
      // two actor meshes may share a name: the proc mesh tells their rows apart
      row.appendChild(el('span', 'mnb-name', `${s.actor || '-'} rank ${rank}${s.mesh ? ` of ${s.mesh}` : ''}`));
      if (s.where) {
        row.appendChild(el('span', 'mnb-detail', ` at ${s.where}`));
      }
      const attach = s.attach;
      if (attach) {
        row.appendChild(
          button('mnb-insert-attach', 'Insert %mesh attach', 'Insert a cell that attaches a debugger console to this rank', () =>
            this.actions.insertCell(attach)
          )
        );
      }
      return row;
    });
  }

  private _logs(lines: ILogLine[]): HTMLElement[] {
    if (!lines.length) {
      return this._empty('No output yet.');
    }
    const pre = el('pre', 'mnb-logs');
    for (const l of lines) {
      const line = el('div', `mnb-log-line mnb-stream-${l.stream}`);
      const tag = el('span', 'mnb-log-tag', `[${l.mesh} ${l.rank}] `);
      tag.addEventListener('click', () => this.actions.openLog(l.mesh, l.rank));
      line.appendChild(tag);
      line.appendChild(document.createTextNode(l.line));
      pre.appendChild(line);
    }
    // keep the newest line in view, as a terminal does
    requestAnimationFrame(() => {
      pre.scrollTop = pre.scrollHeight;
    });
    return [pre];
  }

  private _status: HTMLElement;
  private _start: HTMLButtonElement;
  private _legend: HTMLElement;
  private _legendJson = '';
  private _bodies = new Map<Section, HTMLElement>();
  private _last = new Map<Section, string>();
  /** meshes whose Stop was clicked and has not finished (its dialog, then its request) */
  private _stopping = new Set<string>();
  private _timer: number | null = null;
  private _inflight = false;
  private _again = false;
}
