// A dashboard (%mesh dashboard) is an ipywidget fed by its kernel. When that kernel restarts,
// shuts down or is swapped, JupyterLab keeps the last drawn view: green ranks and "idle" that
// no longer track the mesh, and buttons whose clicks only throw "Cannot send" in the console.
// Mark every dashboard drawn before that moment as not live, and disable its controls.

/** The banner's text: what happened and what to do. */
export const STALE_NOTE =
  'Not live: the kernel that drew this dashboard restarted or stopped. Run its cell again, or use the monarch_nb sidebar.';

/** Mark the dashboards under `root` stale; returns how many were newly marked. */
export function markDashboardsStale(root: HTMLElement): number {
  let marked = 0;
  root.querySelectorAll<HTMLElement>('.mnb-dash:not(.mnb-dash-stale)').forEach(dash => {
    dash.classList.add('mnb-dash-stale');
    const banner = document.createElement('div');
    banner.className = 'mnb-stale-note';
    banner.setAttribute('role', 'status');
    banner.textContent = STALE_NOTE;
    dash.prepend(banner);
    dash.querySelectorAll<HTMLButtonElement | HTMLInputElement>('button, input').forEach(c => {
      c.disabled = true;
    });
    marked += 1;
  });
  return marked;
}

/** Kernel states after which the widgets drawn so far have no live model behind them. */
export function endsWidgets(status: string): boolean {
  return status === 'restarting' || status === 'autorestarting' || status === 'dead';
}
