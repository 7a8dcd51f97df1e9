// JupyterLab 4 plugin: the monarch_nb sidebar and the actions behind its buttons.
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { Dialog, MainAreaWidget, Notification, showDialog } from '@jupyterlab/apputils';
import { INotebookTracker, NotebookActions } from '@jupyterlab/notebook';
import { Widget } from '@lumino/widgets';

import { ILogLine, IMesh, rankLog, startAllocator, stopMesh } from './api';
import { meshIcon } from './icon';
import { MeshSidebar } from './sidebar';
import { endsWidgets, markDashboardsStale } from './stale';

/** A main-area view of one rank's full log, as its allocator keeps it. */
class RankLogView extends Widget {
  constructor(readonly mesh: string, readonly rank: number) {
    super();
    this.addClass('mnb-RankLog');
    // where the rank ran and how it ended
    this._head = document.createElement('div');
    this._head.className = 'mnb-ranklog-head';
    this.node.appendChild(this._head);
    this._pre = document.createElement('pre');
    this._pre.className = 'mnb-ranklog-lines';
    this.node.appendChild(this._pre);
  }

  async load(): Promise<void> {
    this._pre.textContent = 'loading…';
    try {
      const { lines, proc } = await rankLog(this.mesh, this.rank);
      if (proc) {
        this._head.textContent =
          `rank ${this.rank} of ${this.mesh} · host ${proc.host || '?'} · pid ${proc.pid ?? '?'} · ${proc.state}` +
          (proc.cause ? ` · ${proc.cause}` : '');
        this._head.setAttribute('data-state', proc.state);
      }
      this._pre.replaceChildren(...lines.map(formatLine));
      if (!lines.length) {
        this._pre.textContent = `rank ${this.rank} of ${this.mesh} has not printed anything`;
      }
    } catch (e) {
      this._pre.textContent = `${e}`;
      this._pre.classList.add('mnb-error');
    }
  }

  private _pre: HTMLPreElement;
  private _head: HTMLDivElement;
}

function formatLine(l: ILogLine): HTMLElement {
  const div = document.createElement('div');
  div.className = `mnb-log-line mnb-stream-${l.stream}`;
  const t = new Date(l.ts * 1000).toLocaleTimeString();
  div.textContent = `${t} ${l.stream === 'stderr' ? 'E' : ' '} ${l.line}`;
  return div;
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'monarch-nb:sidebar',
  description: 'monarch_nb: allocators, meshes, procs, debug sessions and logs in the left sidebar',
  autoStart: true,
  optional: [INotebookTracker],
  activate: (app: JupyterFrontEnd, tracker: INotebookTracker | null) => {
    const logViews = new Map<string, MainAreaWidget<RankLogView>>();

    const sidebar: MeshSidebar = new MeshSidebar({
      startAllocator: async () => {
        try {
          const r = await startAllocator();
          Notification.success(
            r.started ? `Started an allocator (pid ${r.pid}) at ${r.addr}` : `An allocator is already running (pid ${r.pid})`,
            { autoClose: 4000 }
          );
        } catch (e) {
          Notification.error(`Could not start an allocator: ${e}`);
        }
        await sidebar.refresh();
      },

      stopMesh: async (mesh: IMesh) => {
        const answer = await showDialog({
          title: `Stop mesh ${mesh.name}?`,
          body: `Its ${mesh.procs.length} proc(s) will exit, whichever controller owns it.`,
          buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Stop' })]
        });
        if (!answer.button.accept) {
          return;
        }
        try {
          await stopMesh(mesh.name);
        } catch (e) {
          Notification.error(`Could not stop mesh ${mesh.name}: ${e}`);
        }
        await sidebar.refresh();
      },

      openLog: (mesh: string, rank: number) => {
        const key = `${mesh}/${rank}`;
        let view = logViews.get(key);
        if (!view || view.isDisposed) {
          const content = new RankLogView(mesh, rank);
          view = new MainAreaWidget({ content });
          view.id = `mnb-log-${encodeURIComponent(mesh)}-${rank}`;
          view.title.label = `${mesh} rank ${rank} log`;
          view.title.icon = meshIcon;
          view.title.closable = true;
          view.addClass('mnb-RankLogPanel');
          logViews.set(key, view);
          app.shell.add(view, 'main');
        }
        app.shell.activateById(view.id);
        void view.content.load();
      },

      insertCell: (code: string) => {
        const panel = tracker?.currentWidget;
        if (!panel) {
          Notification.warning('Open a notebook first: the cell goes into the active notebook.', { autoClose: 4000 });
          return;
        }
        const notebook = panel.content;
        NotebookActions.insertBelow(notebook);
        const cell = notebook.activeCell;
        if (cell) {
          cell.model.sharedModel.setSource(code);
        }
        app.shell.activateById(panel.id);
      }
    });
    sidebar.title.icon = meshIcon;
    app.shell.add(sidebar, 'left', { rank: 900 });

    // dashboards drawn by a kernel that restarted or went away stop updating: say so
    tracker?.widgetAdded.connect((_, panel) => {
      const ctx = panel.sessionContext;
      ctx.statusChanged.connect((_, status) => {
        if (endsWidgets(status)) {
          markDashboardsStale(panel.content.node);
        }
      });
      ctx.kernelChanged.connect(() => markDashboardsStale(panel.content.node));
    });
  }
};

export default plugin;
