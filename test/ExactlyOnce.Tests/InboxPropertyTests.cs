using CsCheck;
using ExactlyOnce.EntityFrameworkCore;
using ExactlyOnce.Tests.Infrastructure;
using ExactlyOnce.TestHost;
using Microsoft.EntityFrameworkCore;
using Microsoft.Extensions.DependencyInjection;
using Microsoft.Extensions.Hosting;
using Xunit;

namespace ExactlyOnce.Tests;

/// <summary>
/// The inbox invariant as a property, against real PostgreSQL through the protocol and the EF store: for any set of
/// messages, any number of deliveries of each, in any order, partly concurrent, with any of them failing — every
/// message that had at least one successful delivery has exactly one effect and one processed claim, and every message
/// whose deliveries all failed has none.
/// </summary>
public class InboxPropertyTests : PostgresRabbitTest
{
    private sealed record Delivery(int Message, bool Fails);

    [Fact]
    public async Task AnyRedeliveriesInAnyOrderWithFailures_ProduceExactlyOneEffectPerSucceededMessage()
    {
        var builder = Host.CreateApplicationBuilder(new HostApplicationBuilderSettings { DisableDefaults = true });
        builder.Services.AddDbContext<TestDbContext>(o => o.UseNpgsql(ConnectionString));
        builder.Services.AddExactlyOnce<TestDbContext>(o => o.Batching.Enabled = Batched);
        using var host = builder.Build();
        var protocol = host.Services.GetRequiredService<InboxProtocol>();
        int round = 0;

        // About one delivery in four fails after its write.
        var deliveries = Gen.Select(Gen.Int[0, 5], Gen.Int[0, 3]).Select((m, f) => new Delivery(m, f == 0)).Array[1, 24];
        await deliveries.SampleAsync(async batch =>
        {
            string consumer = $"property-{Interlocked.Increment(ref round)}";
            var ids = Enumerable.Range(0, 6).Select(_ => Guid.NewGuid()).ToArray();
            // Deliveries run four at a time, so copies of one message meet inside the database.
            foreach (var wave in batch.Chunk(4))
            {
                await Task.WhenAll(wave.Select(d => DeliverAsync(host, protocol, new InboxKey(ids[d.Message], consumer), d.Fails)));
            }

            await using var db = NewContext();
            var effects = await db.Effects.Where(e => e.Consumer == consumer).GroupBy(e => e.MessageId).Select(g => new { g.Key, Count = g.Count() }).ToListAsync();
            var claims = await db.Set<InboxMessage>().Where(m => m.ConsumerType == consumer).ToListAsync();
            for (int m = 0; m < ids.Length; m++)
            {
                bool anySucceeded = batch.Any(d => d.Message == m && !d.Fails);
                int count = effects.SingleOrDefault(e => e.Key == ids[m])?.Count ?? 0;
                int claimed = claims.Count(c => c.Id == ids[m] && c.ProcessedAt is not null);
                if (count != (anySucceeded ? 1 : 0) || claimed != count || claims.Count(c => c.Id == ids[m]) != claimed)
                {
                    return false;
                }
            }

            return true;
        }, iter: 40, threads: 1);
    }

    private static async Task DeliverAsync(IHost host, InboxProtocol protocol, InboxKey key, bool fails)
    {
        await using var scope = host.Services.CreateAsyncScope();
        var store = scope.ServiceProvider.GetRequiredService<IInboxStore>();
        var db = scope.ServiceProvider.GetRequiredService<TestDbContext>();
        try
        {
            await protocol.ProcessAsync(store, key, async ct =>
            {
                db.Effects.Add(new Effect { MessageId = key.MessageId, Consumer = key.ConsumerName });
                await db.SaveChangesAsync(ct);
                if (fails)
                {
                    throw new InvalidOperationException("this delivery fails after its write");
                }
            });
        }
        catch (InvalidOperationException) when (fails)
        {
            // the failure was the point: nothing of it may remain
        }
    }
}
