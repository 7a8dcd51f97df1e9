// REST client for the monarch_nb jupyter_server extension (monarch_nb/server/handlers.py).
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

export interface IProc {
  rank: number;
  pid: number | null;
  /** the dashboard's state: idle, busy, paused, failed, stopped (or starting, unknown) */
  state: string;
  /** the allocator's word for the process: starting, running, failed, ... */
  proc_state?: string;
  activity?: string;
  reason?: string;
  cause: string;
  host: string;
  alloc: string;
}

export interface IMesh {
  name: string;
  /** the mesh as a whole: failed when one rank failed */
  state: string;
  /** what the dashboard and %mesh status say: "failed (healthy ranks still callable; new spawns refused)" */
  label: string;
  /** what to do about it */
  hint: string;
  owner: string;
  labels: string[];
  sizes: number[];
  actors: string[];
  allocators: string[];
  hosts: string[];
  procs: IProc[];
}

export interface IAllocator {
  id: string;
  addr: string;
  tcp: string;
  host: string;
  pid: number | null;
  alive: boolean;
  error: string;
  controllers: number;
  meshes: string[];
}

export interface IHost {
  host: string;
  allocators: string[];
  procs: number;
  states: { [state: string]: number };
}

export interface IDebugSession {
  mesh?: string;
  actor?: string;
  actor_id?: string;
  rank?: number;
  host?: string;
  /** file:line in function, where the rank stopped */
  where?: string;
  /** the %mesh attach line that reaches this session (by actor id when two actor meshes share its name) */
  attach?: string;
  [key: string]: unknown;
}

export interface ILogLine {
  ts: number;
  mesh: string;
  rank: number;
  stream: string;
  line: string;
}

export interface IJob {
  name: string;
  scheduler: string;
  id: string;
  /** the scheduler's state, or "lost" when it lost some of the job's hosts */
  state: string;
  detail: string;
  hosts: number;
  lost: string[];
  age_s: number | null;
  walltime_left_s: number | null;
}

export interface IState {
  time: number;
  runtime_dir: string;
  /** the states the legend shows and their colours (the dashboard's) */
  legend: { [state: string]: string };
  /** every rank state's colour */
  colours: { [state: string]: string };
  /** an allocator runs on the Jupyter server's host */
  local_allocator: boolean;
  jobs: IJob[];
  allocators: IAllocator[];
  hosts: IHost[];
  meshes: IMesh[];
  debug_sessions: IDebugSession[];
  logs: ILogLine[];
}

export class ApiError extends Error {}

async function request<T>(path: string[], init: RequestInit = {}, query = ''): Promise<T> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'monarch-nb', 'api', ...path.map(encodeURIComponent)) + query;
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (e) {
    throw new ApiError(`cannot reach the Jupyter server: ${e}`);
  }
  const text = await response.text();
  let body: any = null;
  try {
    body = text ? JSON.parse(text) : null;
  } catch {
    body = null;
  }
  if (!response.ok) {
    const msg = (body && body.message) || response.statusText || text;
    throw new ApiError(`${response.status}: ${msg}`);
  }
  return body as T;
}

export function getState(): Promise<IState> {
  return request<IState>(['state']);
}

export function startAllocator(): Promise<{ started: boolean; addr: string; pid: number }> {
  return request(['allocators'], { method: 'POST', body: '{}' });
}

export function stopMesh(name: string): Promise<{ mesh: string; stopped_procs: number }> {
  return request(['meshes', name, 'stop'], { method: 'POST', body: '{}' });
}

export interface IRankInfo {
  host: string;
  pid: number | null;
  state: string;
  cause: string;
}

export function rankLog(mesh: string, rank: number, tail = 2000): Promise<{ lines: ILogLine[]; proc: IRankInfo }> {
  return request(['meshes', mesh, 'ranks', String(rank), 'log'], {}, `?tail=${tail}`);
}
