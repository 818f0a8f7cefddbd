using System.Diagnostics;
using ExactlyOnce.Tests.Infrastructure;
using ExactlyOnce.TestHost;
using MassTransit;
using Microsoft.EntityFrameworkCore;
using Microsoft.Extensions.DependencyInjection;
using Microsoft.Extensions.Diagnostics.Metrics.Testing;
using Xunit;

namespace ExactlyOnce.Tests;

/// <summary>A consumer process killed with SIGKILL between commit and acknowledgement.</summary>
public sealed class CrashTests : PostgresRabbitTest
{
    [Fact]
    public async Task Consume_ProcessKilledAfterCommitBeforeAck_RabbitRedelivers_CopyDiscardedAsDuplicate()
    {
        string queue = Queue("crash");
        var id = NewId.NextGuid();
        var sender = await StartHostAsync(new TestHosts.Options
        {
            Database = o => o.UseNpgsql(ConnectionString),
            Consumers = _ => { },
            Endpoints = (_, _) => { },
            InboxOnAllEndpoints = false,
        });

        using (var child = new ChildProcess("block-after-commit", DatabaseName, queue))
        {
            await child.WaitForLineAsync("READY", TimeSpan.FromSeconds(60));
            await SendAsync(sender, queue, id);
            await child.WaitForLineAsync("COMMITTED " + id, TimeSpan.FromSeconds(60));

            // Committed, not acknowledged: the effect is durable and RabbitMQ still holds the message unacked.
            Assert.Equal(1, await CountEffectsAsync(id));
            Assert.Equal(0u, await RabbitAdmin.CountAsync(queue));
            child.Kill();
            Assert.Equal(137, child.ExitCode); // 128 + SIGKILL
        }

        await Eventually.AssertAsync(async () => await RabbitAdmin.CountAsync(queue) == 1, "RabbitMQ requeued the unacknowledged message");
        var counter = new DeliveryCounter();
        var restarted = await StartConsumerHostAsync<EffectConsumer>(queue, counter);
        using var duplicates = new MetricCollector<long>(restarted.Services.GetRequiredService<System.Diagnostics.Metrics.IMeterFactory>(),
            "ExactlyOnce", "exactlyonce.inbox.messages.duplicates");
        await Eventually.AssertAsync(() => Task.FromResult(counter.Handled >= 1), "redelivery handled by the restarted consumer");

        Assert.Equal(1, duplicates.GetMeasurementSnapshot().EvaluateAsCounter());
        Assert.Equal(0, Probe.Entries(id, nameof(EffectConsumer))); // the restarted consumer's body never ran
        Assert.Equal(1, await CountEffectsAsync(id));
        Assert.NotNull(Assert.Single(await InboxRowsAsync(id)).ProcessedAt);
        Assert.Equal(0u, await RabbitAdmin.CountAsync(queue));
        Assert.Equal(0u, await RabbitAdmin.CountAsync(queue + "_error"));
    }
}

/// <summary>Runs ExactlyOnce.TestHost as a separate process and reads its stdout line by line.</summary>
internal sealed class ChildProcess : IDisposable
{
    private readonly Process _process;
    private readonly List<string> _lines = [];
    private readonly SemaphoreSlim _lineAdded = new(0);

    public ChildProcess(params string[] args)
    {
        string dll = Path.Combine(AppContext.BaseDirectory, "ExactlyOnce.TestHost.dll");
        var start = new ProcessStartInfo("dotnet") { RedirectStandardOutput = true, RedirectStandardError = true, UseShellExecute = false };
        start.ArgumentList.Add(dll);
        foreach (string arg in args)
        {
            start.ArgumentList.Add(arg);
        }

        _process = new Process { StartInfo = start };
        _process.OutputDataReceived += (_, e) =>
        {
            if (e.Data is null)
            {
                return;
            }

            lock (_lines)
            {
                _lines.Add(e.Data);
            }

            _lineAdded.Release();
        };
        _process.ErrorDataReceived += (_, e) =>
        {
            if (e.Data is not null)
            {
                lock (_lines)
                {
                    _lines.Add("stderr: " + e.Data);
                }
            }
        };
        _process.Start();
        _process.BeginOutputReadLine();
        _process.BeginErrorReadLine();
    }

    public int ExitCode => _process.ExitCode;

    public async Task WaitForLineAsync(string line, TimeSpan timeout)
    {
        var deadline = Stopwatch.StartNew();
        while (true)
        {
            lock (_lines)
            {
                if (_lines.Contains(line))
                {
                    return;
                }
            }

            if (_process.HasExited || deadline.Elapsed > timeout)
            {
                string output;
                lock (_lines)
                {
                    output = string.Join(Environment.NewLine, _lines);
                }

                throw new TimeoutException($"'{line}' not printed (exited: {_process.HasExited}). Output:{Environment.NewLine}{output}");
            }

            await _lineAdded.WaitAsync(TimeSpan.FromMilliseconds(200));
        }
    }

    /// <summary>SIGKILL: no shutdown hooks, no acknowledgement, no cleanup.</summary>
    public void Kill()
    {
        _process.Kill(entireProcessTree: false);
        _process.WaitForExit();
    }

    public void Dispose()
    {
        if (!_process.HasExited)
        {
            Kill();
        }

        _process.Dispose();
        _lineAdded.Dispose();
    }
}
