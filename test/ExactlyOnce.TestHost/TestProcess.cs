using System.Diagnostics;
using System.Net;
using System.Net.Sockets;

namespace ExactlyOnce.TestHost;

/// <summary>
/// Runs one of the solution's executables (copied next to the test assembly) as a separate process, collects its
/// output line by line, and can kill it with SIGKILL. Shared by the crash, fault and end-to-end tests.
/// </summary>
public class TestProcess : IDisposable
{
    private readonly Process _process;
    private readonly List<string> _lines = [];

    public TestProcess(string assemblyFileName, params string[] args)
    {
        var start = new ProcessStartInfo("dotnet") { RedirectStandardOutput = true, RedirectStandardError = true, UseShellExecute = false };
        start.ArgumentList.Add(Path.Combine(AppContext.BaseDirectory, assemblyFileName));
        foreach (string arg in args)
        {
            start.ArgumentList.Add(arg);
        }

        _process = new Process { StartInfo = start };
        _process.OutputDataReceived += (_, e) => Add(e.Data);
        _process.ErrorDataReceived += (_, e) => Add(e.Data is null ? null : "stderr: " + e.Data);
        _process.Start();
        _process.BeginOutputReadLine();
        _process.BeginErrorReadLine();
    }

    public IReadOnlyList<string> Lines
    {
        get
        {
            lock (_lines)
            {
                return [.. _lines];
            }
        }
    }

    public bool HasExited => _process.HasExited;

    public int ExitCode => _process.ExitCode;

    public static int FreePort()
    {
        using var listener = new TcpListener(IPAddress.Loopback, 0);
        listener.Start();
        return ((IPEndPoint)listener.LocalEndpoint).Port;
    }

    public async Task WaitForOutputAsync(string fragment, TimeSpan timeout)
    {
        var clock = Stopwatch.StartNew();
        while (!Lines.Any(l => l.Contains(fragment, StringComparison.Ordinal)))
        {
            if (_process.HasExited || clock.Elapsed > timeout)
            {
                throw new TimeoutException($"'{fragment}' not printed (exited: {_process.HasExited}). Output:{Environment.NewLine}{string.Join(Environment.NewLine, Lines.TakeLast(60))}");
            }

            await Task.Delay(50);
        }
    }

    public async Task<int> WaitForExitAsync(TimeSpan timeout)
    {
        using var cts = new CancellationTokenSource(timeout);
        await _process.WaitForExitAsync(cts.Token);
        _process.WaitForExit(); // drain the output
        return _process.ExitCode;
    }

    /// <summary>SIGKILL: no shutdown, no acknowledgements, no cleanup.</summary>
    public void Kill()
    {
        if (!_process.HasExited)
        {
            _process.Kill(entireProcessTree: false);
            _process.WaitForExit();
        }
    }

    public void Dispose()
    {
        Kill();
        _process.Dispose();
        GC.SuppressFinalize(this);
    }

    private void Add(string? line)
    {
        if (line is null)
        {
            return;
        }

        lock (_lines)
        {
            _lines.Add(line);
        }
    }
}
