using ExactlyOnce.Tests.Infrastructure;
using ExactlyOnce.TestHost;
using MassTransit;
using Microsoft.EntityFrameworkCore;
using Microsoft.Extensions.DependencyInjection;
using Microsoft.Extensions.Diagnostics.Metrics.Testing;
using Xunit;

namespace ExactlyOnce.Tests;

/// <summary>A consumer process killed with SIGKILL between commit and acknowledgement.</summary>
public class CrashTests : PostgresRabbitTest
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

        using (var child = new ChildProcess("block-after-commit", DatabaseName, queue, Batched ? "batched" : "single"))
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

/// <summary>ExactlyOnce.TestHost as a separate process (see its Program.cs for the modes).</summary>
internal sealed class ChildProcess(params string[] args) : TestProcess("ExactlyOnce.TestHost.dll", args)
{
    public Task WaitForLineAsync(string line, TimeSpan timeout) => WaitForOutputAsync(line, timeout);
}
