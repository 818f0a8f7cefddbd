using System.Diagnostics;
using System.Diagnostics.Metrics;
using ExactlyOnce.Tests.Infrastructure;
using ExactlyOnce.TestHost;
using MassTransit;
using Microsoft.Extensions.DependencyInjection;
using Microsoft.Extensions.Diagnostics.Metrics.Testing;
using Microsoft.Extensions.Logging;
using Microsoft.Extensions.Logging.Testing;
using Xunit;

namespace ExactlyOnce.Tests;

/// <summary>The inbox's instruments, spans and logs, by exact name, unit and tags, on a real pipeline.</summary>
public class TelemetryTests : PostgresRabbitTest
{
    private const string Consumer = "ExactlyOnce.TestHost.EffectConsumer";

    [Fact]
    public async Task Inbox_ProcessedDuplicateAndFailed_AreCountedTimedTaggedTracedAndLogged()
    {
        string queue = Queue("telemetry");
        var counter = new DeliveryCounter();
        var activities = new List<Activity>();
        using var listener = new ActivityListener
        {
            ShouldListenTo = source => source.Name is "ExactlyOnce" or "MassTransit",
            Sample = (ref ActivityCreationOptions<ActivityContext> _) => ActivitySamplingResult.AllDataAndRecorded,
            ActivityStopped = a =>
            {
                lock (activities)
                {
                    activities.Add(a);
                }
            },
        };
        ActivitySource.AddActivityListener(listener);
        var failing = NewId.NextGuid();
        Probe.AfterSave = (context, _) => context.MessageId == failing ? throw new InvalidOperationException("fails") : Task.CompletedTask;
        var host = await StartConsumerHostAsync<EffectConsumer>(queue, counter, services: s => s
            .AddFakeLogging()
            .Configure<LoggerFilterOptions>(o => o.MinLevel = LogLevel.Information)); // event 1003 is Information
        var meters = host.Services.GetRequiredService<IMeterFactory>();
        using var processed = new MetricCollector<long>(meters, "ExactlyOnce", "exactlyonce.inbox.messages.processed");
        using var duplicates = new MetricCollector<long>(meters, "ExactlyOnce", "exactlyonce.inbox.messages.duplicates");
        using var failed = new MetricCollector<long>(meters, "ExactlyOnce", "exactlyonce.inbox.messages.failed");
        using var duration = new MetricCollector<double>(meters, "ExactlyOnce", "exactlyonce.inbox.process.duration");
        using var claim = new MetricCollector<double>(meters, "ExactlyOnce", "exactlyonce.inbox.claim.duration");
        var id = NewId.NextGuid();

        await SendAsync(host, queue, id);
        await Eventually.AssertAsync(() => Task.FromResult(counter.Handled >= 1), "processed");
        await SendAsync(host, queue, id);
        await SendAsync(host, queue, failing);
        await Eventually.AssertAsync(() => Task.FromResult(counter.Handled >= 3), "duplicate and failure handled");

        Assert.Equal("{message}", processed.Instrument!.Unit);
        Assert.Equal(1, Assert.Single(processed.GetMeasurementSnapshot()).Value);
        Assert.Equal(Consumer, processed.LastMeasurement!.Tags["exactlyonce.consumer.name"]);
        Assert.Equal(1, duplicates.GetMeasurementSnapshot().EvaluateAsCounter());
        Assert.Equal("{message}", failed.Instrument!.Unit);
        Assert.Equal(Consumer, Assert.Single(failed.GetMeasurementSnapshot()).Tags["exactlyonce.consumer.name"]);
        Assert.Equal("s", duration.Instrument!.Unit);
        Assert.Equal(["duplicate", "failed", "processed"], duration.GetMeasurementSnapshot().Select(m => (string)m.Tags["exactlyonce.inbox.outcome"]!).Order());
        Assert.All(duration.GetMeasurementSnapshot(), m =>
        {
            Assert.Equal(Consumer, m.Tags["exactlyonce.consumer.name"]);
            Assert.Equal(2, m.Tags.Count); // consumer and outcome; never the message id
            Assert.InRange(m.Value, 0, 30);
        });
        Assert.Equal("s", claim.Instrument!.Unit);
        Assert.Equal(3, claim.GetMeasurementSnapshot().Count);

        List<Activity> spans;
        lock (activities)
        {
            spans = activities.Where(a => a.Source.Name == "ExactlyOnce").ToList();
        }

        var processedSpan = Assert.Single(spans, a => (string?)a.GetTagItem("exactlyonce.inbox.outcome") == "processed");
        Assert.Equal("inbox process " + Consumer, processedSpan.DisplayName);
        Assert.Equal(id.ToString(), processedSpan.GetTagItem("messaging.message.id"));
        Assert.Equal(Consumer, processedSpan.GetTagItem("exactlyonce.consumer.name"));
        Assert.Single(spans, a => (string?)a.GetTagItem("exactlyonce.inbox.outcome") == "duplicate");
        var failedSpan = Assert.Single(spans, a => (string?)a.GetTagItem("exactlyonce.inbox.outcome") == "failed");
        Assert.Equal(ActivityStatusCode.Error, failedSpan.Status);
        Assert.NotNull(processedSpan.Parent);
        Assert.Equal("processed", processedSpan.Parent!.GetTagItem("exactlyonce.inbox.outcome")); // the consume span too

        var logs = host.Services.GetFakeLogCollector().GetSnapshot();
        var duplicateLog = Assert.Single(logs, r => r.Id.Id == 1001);
        Assert.Equal(LogLevel.Warning, duplicateLog.Level);
        Assert.Equal("InboxDuplicateDiscarded", duplicateLog.Id.Name);
        var failureLog = Assert.Single(logs, r => r.Id.Id == 1003);
        Assert.Equal("InboxProcessingFailed", failureLog.Id.Name);
        Assert.NotNull(failureLog.Exception);
    }
}
