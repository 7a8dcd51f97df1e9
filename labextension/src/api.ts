// REST client for the monarch_nb jupyter_server extension (monarch_nb/server/handlers.py).
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

export interface IProc {
  rank: number;
  pid: number | null;
  state: string;
  cause: string;
  host: string;
  alloc: string;
}

export interface IMesh {
  name: string;
  state: string;
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
  rank?: number;
  host?: string;
  where?: string;
  [key: string]: unknown;
}

export interface ILogLine {
  ts: number;
  mesh: string;
  rank: number;
  stream: string;
  line: string;
}

export interface IState {
  time: number;
  runtime_dir: string;
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

export function rankLog(mesh: string, rank: number, tail = 2000): Promise<{ lines: ILogLine[] }> {
  return request(['meshes', mesh, 'ranks', String(rank), 'log'], {}, `?tail=${tail}`);
}
