using System.Diagnostics;

namespace ParcelTracker.Hosting;

/// <summary>
/// The demo's crash mode: the consumers as a child process that kills itself with SIGKILL at random crash points;
/// whenever it dies it is started again, until the demo is over.
/// </summary>
internal sealed class CrashingChildren(string[] appArgs) : IAsyncDisposable
{
    private readonly CancellationTokenSource _stop = new();
    private Task? _loop;
    private int _kills;
    private long _duplicates;

    public int Kills => Volatile.Read(ref _kills);

    /// <summary>Duplicate deliveries the children discarded, counted from their logs (event 1001).</summary>
    public long DuplicatesDiscarded => Interlocked.Read(ref _duplicates);

    public async Task StartAsync()
    {
        var ready = new TaskCompletionSource(TaskCreationOptions.RunContinuationsAsynchronously);
        _loop = Task.Run(() => LoopAsync(ready));
        await ready.Task.WaitAsync(TimeSpan.FromMinutes(2));
    }

    private async Task LoopAsync(TaskCompletionSource ready)
    {
        while (!_stop.IsCancellationRequested)
        {
            using var process = Start();
            process.OutputDataReceived += (_, e) =>
            {
                if (e.Data is null)
                {
                    return;
                }

                if (e.Data.Contains("[1001]", StringComparison.Ordinal))
                {
                    Interlocked.Increment(ref _duplicates);
                }

                if (e.Data.Contains("Bus started", StringComparison.Ordinal))
                {
                    ready.TrySetResult();
                }
            };
            process.BeginOutputReadLine();
            process.BeginErrorReadLine();
            try
            {
                await process.WaitForExitAsync(_stop.Token);
            }
            catch (OperationCanceledException)
            {
                process.Kill(entireProcessTree: true);
                await process.WaitForExitAsync();
                return;
            }

            Interlocked.Increment(ref _kills);
        }
    }

    private Process Start()
    {
        string host = Environment.ProcessPath ?? "dotnet";
        var info = new ProcessStartInfo(host) { RedirectStandardOutput = true, RedirectStandardError = true, UseShellExecute = false };
        if (Path.GetFileNameWithoutExtension(host) == "dotnet")
        {
            info.ArgumentList.Add(typeof(CrashingChildren).Assembly.Location);
        }

        info.ArgumentList.Add("consumer");
        foreach (string arg in appArgs)
        {
            info.ArgumentList.Add(arg);
        }

        info.Environment["Logging__Console__FormatterName"] = "simple";
        return Process.Start(info) ?? throw new InvalidOperationException("could not start the consumer process");
    }

    public async ValueTask DisposeAsync()
    {
        await _stop.CancelAsync();
        if (_loop is not null)
        {
            await _loop;
        }

        _stop.Dispose();
    }
}
